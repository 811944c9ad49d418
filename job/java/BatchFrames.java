package clusterserving.flink;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.apache.flink.types.Row;

/**
 * How a micro-batch crosses between the JVM and the Python inference operator: one byte array per
 * batch instead of one Python call per request. Little-endian: a uint32 count, then per record a
 * uint32 uri length (0xFFFFFFFF for a record without a key), the uri's UTF-8 bytes, a uint32
 * payload length and the payload. job/frames.py reads and writes the same layout.
 */
public final class BatchFrames {
    private static final int NO_URI = -1;

    private BatchFrames() {}

    /** The frame of Row(uri, payload) records. */
    public static byte[] encode(List<Row> records) {
        List<byte[]> uris = new ArrayList<>(records.size());
        long size = 4;
        for (Row record : records) {
            String uri = (String) record.getField(0);
            byte[] key = uri == null ? null : uri.getBytes(StandardCharsets.UTF_8);
            uris.add(key);
            size += 8 + (key == null ? 0 : key.length) + payload(record).length;
        }
        if (size > Integer.MAX_VALUE - 8) {
            throw new IllegalStateException("a micro-batch of " + size + " bytes does not fit one frame");
        }
        ByteBuffer frame = ByteBuffer.allocate((int) size).order(ByteOrder.LITTLE_ENDIAN);
        frame.putInt(records.size());
        for (int i = 0; i < records.size(); i++) {
            byte[] key = uris.get(i);
            frame.putInt(key == null ? NO_URI : key.length);
            if (key != null) {
                frame.put(key);
            }
            byte[] value = payload(records.get(i));
            frame.putInt(value.length);
            frame.put(value);
        }
        return frame.array();
    }

    /** The Row(uri, payload) records of a frame. */
    public static List<Row> decode(byte[] bytes) {
        ByteBuffer frame = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN);
        int count = frame.getInt();
        List<Row> records = new ArrayList<>(count);
        for (int i = 0; i < count; i++) {
            int uriLength = frame.getInt();
            String uri = null;
            if (uriLength != NO_URI) {
                uri = new String(bytes, frame.position(), uriLength, StandardCharsets.UTF_8);
                frame.position(frame.position() + uriLength);
            }
            byte[] value = new byte[frame.getInt()];
            frame.get(value);
            records.add(Row.of(uri, value));
        }
        return records;
    }

    static byte[] payload(Row record) {
        byte[] value = (byte[]) record.getField(1);
        return value == null ? new byte[0] : value;
    }
}
