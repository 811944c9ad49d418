package clusterserving.flink;

import java.nio.charset.StandardCharsets;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;
// The connector jar carries kafka-clients relocated under org.apache.flink.kafka.shaded.
import org.apache.flink.kafka.shaded.org.apache.kafka.clients.consumer.ConsumerRecord;

/**
 * Emits Row(key as UTF-8 string or null, value bytes) for every Kafka record, so the job knows a
 * request's uri (the record key) even when the value cannot be decoded.
 */
public final class KeyValueDeserializationSchema implements KafkaRecordDeserializationSchema<Row> {
    private static final long serialVersionUID = 1L;

    @Override
    public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Row> out) {
        byte[] key = record.key();
        String uri = key == null ? null : new String(key, StandardCharsets.UTF_8);
        out.collect(Row.of(uri, record.value()));
    }

    @Override
    public TypeInformation<Row> getProducedType() {
        return Types.ROW(Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE));
    }
}
