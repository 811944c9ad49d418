package clusterserving.flink;

import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.types.Row;
import org.apache.flink.kafka.shaded.org.apache.kafka.clients.producer.ProducerRecord;

/**
 * Writes SplitResults' Row(key, value, headers): a result (headers null) to the result topic, a
 * dead letter (its headers a HeaderBlock) to the dead-letter topic. One sink for both, so that
 * under exactly-once a request's dead letter is committed in the same transaction as its error
 * result.
 */
public final class ResultRecordSerializationSchema implements KafkaRecordSerializationSchema<Row> {
    private static final long serialVersionUID = 1L;

    private final String resultTopic;
    private final String deadLetterTopic;

    /** `deadLetterTopic` null or empty: dead letters are dropped (Python writes none then). */
    public ResultRecordSerializationSchema(String resultTopic, String deadLetterTopic) {
        this.resultTopic = resultTopic;
        this.deadLetterTopic = deadLetterTopic == null || deadLetterTopic.isEmpty() ? null : deadLetterTopic;
    }

    @Override
    public ProducerRecord<byte[], byte[]> serialize(Row row, KafkaSinkContext context, Long timestamp) {
        byte[] key = (byte[]) row.getField(0);
        byte[] value = (byte[]) row.getField(1);
        byte[] headers = row.getArity() > 2 ? (byte[]) row.getField(2) : null;
        if (headers == null) {
            return new ProducerRecord<>(resultTopic, null, null, key, value);
        }
        if (deadLetterTopic == null) {
            return null;
        }
        return new ProducerRecord<>(deadLetterTopic, null, null, key, value, HeaderBlock.decode(headers));
    }
}
