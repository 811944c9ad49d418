package clusterserving.flink;

import java.nio.charset.StandardCharsets;
import org.apache.flink.api.common.serialization.SerializationSchema;
import org.apache.flink.types.Row;

/**
 * Writes one field of a Row as raw bytes, so the Kafka sink can take the record key (the uri)
 * and the value (the encoded result) from two fields of the same element. PyFlink offers no
 * built-in schema for this.
 */
public final class RowFieldSerializationSchema implements SerializationSchema<Row> {
    private static final long serialVersionUID = 1L;
    private final int field;

    public RowFieldSerializationSchema(int field) {
        this.field = field;
    }

    @Override
    public byte[] serialize(Row row) {
        Object value = row.getField(field);
        if (value instanceof String) {
            return ((String) value).getBytes(StandardCharsets.UTF_8);
        }
        return (byte[]) value;
    }
}
