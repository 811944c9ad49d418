package clusterserving.flink;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import org.apache.flink.types.Row;

/**
 * How a micro-batch crosses between the JVM and the Python inference operator: one byte array per
 * batch instead of one Python call per request. Little-endian. The record part: a uint32 count,
 * then per record a uint32 uri length (0xFFFFFFFF for a record without a key), the uri's UTF-8
 * bytes, a uint32 payload length and the payload. A frame to Python starts with a header, a uint32
 * length and that many UTF-8 bytes: "B" + model + TAB + version for a batch of one route (as the
 * requests' headers said, "" when absent), "C" + table text for a control frame (zero records: the
 * routing table the batches after it were made by). The results frame back from Python is the
 * record part alone. job/frames.py reads and writes the same layouts.
 */
public final class BatchFrames {
    private static final int NO_URI = -1;

    private BatchFrames() {}

    /** The frame of a batch of Row(uri, payload, ...) requests of one route. */
    public static byte[] encodeBatch(String model, String version, List<Row> records) {
        return encode("B" + model + "\t" + version, records);
    }

    /** The control frame announcing a routing table. */
    public static byte[] encodeControl(String tableText) {
        return encode("C" + tableText, Collections.emptyList());
    }

    private static byte[] encode(String headerText, List<Row> records) {
        byte[] header = headerText.getBytes(StandardCharsets.UTF_8);
        List<byte[]> uris = new ArrayList<>(records.size());
        long size = 8L + header.length;
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
        frame.putInt(header.length);
        frame.put(header);
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

    /** The Row(uri, payload) records of a results frame (no header). */
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

    /** The payload (field 1) of a request or result row; none is an empty one. */
    static byte[] payload(Row record) {
        byte[] value = (byte[]) record.getField(1);
        return value == null ? new byte[0] : value;
    }
}
