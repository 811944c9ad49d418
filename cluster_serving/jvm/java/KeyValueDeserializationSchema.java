package clusterserving.flink;

import java.nio.charset.StandardCharsets;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;
// The connector jar carries kafka-clients relocated under org.apache.flink.kafka.shaded.
import org.apache.flink.kafka.shaded.org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.Header;

/**
 * Emits Row(uri, payload, model, version, control) for every Kafka record: the key as a UTF-8
 * string or null, so the job knows a request's uri even when the value cannot be decoded; the
 * value bytes; the `model` and `version` headers as UTF-8 strings (null when absent or empty);
 * control true for a record with a `cluster-serving-control` header, whose value is a routing
 * table (RoutingTable) rather than a request. job/batch.py's REQUEST_ROW is the same type.
 */
public final class KeyValueDeserializationSchema implements KafkaRecordDeserializationSchema<Row> {
    private static final long serialVersionUID = 1L;
    public static final String MODEL_HEADER = "model";
    public static final String VERSION_HEADER = "version";
    public static final String CONTROL_HEADER = "cluster-serving-control";
    private static final String[] FIELDS = {"uri", "payload", "model", "version", "control"};

    @Override
    public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Row> out) {
        byte[] key = record.key();
        String uri = key == null ? null : new String(key, StandardCharsets.UTF_8);
        boolean control = record.headers().lastHeader(CONTROL_HEADER) != null;
        out.collect(Row.of(
            uri, record.value(), header(record, MODEL_HEADER), header(record, VERSION_HEADER), control));
    }

    /** The last value of a header as UTF-8 text; null when absent or empty. */
    private static String header(ConsumerRecord<byte[], byte[]> record, String name) {
        Header header = record.headers().lastHeader(name);
        byte[] value = header == null ? null : header.value();
        return value == null || value.length == 0 ? null : new String(value, StandardCharsets.UTF_8);
    }

    @Override
    public TypeInformation<Row> getProducedType() {
        return Types.ROW_NAMED(
            FIELDS, Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE), Types.STRING, Types.STRING, Types.BOOLEAN);
    }
}
