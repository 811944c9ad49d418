package clusterserving.flink;

import org.apache.flink.api.common.serialization.SerializationSchema;
import org.apache.flink.types.Row;

/**
 * Writes one byte[] field of a Row as it is, so the Kafka sink can take the record key and the
 * value from two fields of the same element (SplitResults' Row(key, value)). PyFlink offers no
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
        return (byte[]) row.getField(field);
    }
}
