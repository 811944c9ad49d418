package clusterserving.flink;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import org.apache.flink.types.Row;

/**
 * How a micro-batch crosses between the JVM and the Python inference operator: one byte array per
 * batch instead of one Python call per request. Little-endian. The record part: a uint32 count,
 * then per record a uint32 uri length (0xFFFFFFFF for a record without a key), the uri's UTF-8
 * bytes, a uint32 payload length and the payload. A frame to Python starts with a header, a uint32
 * length and that many UTF-8 bytes: "B" + model + TAB + version for a batch of one route (as the
 * requests' headers said, "" when absent), then its record part and its sources block; "C" + table
 * text for a control frame (zero records: the routing table the batches after it were made by);
 * "P" for a poll frame and "D" for a drain frame (zero records: what Python finished since, and
 * everything it holds, at the end of the input). Request frames ("A", "B") are numbered in the
 * order they are sent, from 0 in each run of the task.
 * The sources block says where each request came from, for its dead letter: per request an int32
 * partition and an int64 offset (-1 when not known) and its other headers (HeaderBlock; a uint32
 * length, 0xFFFFFFFF for none, and the block).
 *
 * <p>A batch whose requests are all alike (format 2 messages with the same layout, each under its
 * own uri as the record key, no headers but the route's) goes as "A" + model + TAB + version
 * instead, its requests taken apart here so that Python reads the batch without a step per
 * request: a uint32 count, the shared layout (uint32 length, bytes), a uint32 value size, the uris
 * block (uint32 byte length, then per request a uint32 length and the UTF-8 uri), the values block
 * (each request's values one after another, value size bytes each) and the sources block.
 *
 * <p>The results frame back from Python starts with the numbers of the request frames it answers
 * (a uint32 count, then an int64 each: AnsweredBatches), then a record part, the dead letters (a uint32 count, then
 * per dead letter a record as in the record part, a uint32 uri length 0xFFFFFFFF for none, and
 * its headers: a uint32 length and a HeaderBlock), then any number of alike sections, one per
 * stacked run: a uint32 count, the shared layout tail (as format 2 writes it: uint32 length,
 * JSON), a uint32 row size, a uris block as above and the rows block. Each row is one result:
 * its message is the format 2 header, the uri, the layout tail and the row, written here.
 * cluster_serving/runtime/frames.py reads and writes the same layouts.
 */
public final class BatchFrames {
    private static final int NO_URI = -1;
    private static final byte[] V2_MAGIC = {'C', 'S', 'T', '2'};
    // The magic and a uint16 uri length; then the uri, a uint32 layout length and the layout.
    private static final int V2_URI_AT = 6;
    // A request row's fields (KeyValueDeserializationSchema); a shorter row has no source.
    private static final int PARTITION = 5;
    private static final int OFFSET = 6;
    private static final int HEADERS = 7;
    // A source without headers: partition, offset, headers length.
    private static final int PLAIN_SOURCE_BYTES = 16;

    private BatchFrames() {}

    /**
     * The frame of a batch of Row(uri, payload, ...) requests of one route: "A" when they are
     * alike, each with a uri of at most `maxUriChars` and a payload of at most `maxInstanceBytes`
     * (what Python would refuse goes the per-request way, "B", to get its error result there).
     */
    public static byte[] encodeBatch(String model, String version, List<Row> records, int maxUriChars,
                                     long maxInstanceBytes) {
        byte[] alike = encodeAlike(model, version, records, maxUriChars, maxInstanceBytes);
        return alike != null ? alike : encode("B" + model + "\t" + version, records);
    }

    /**
     * The frames of a route's requests due at once, each with the requests it holds: more than
     * `batchSize` of them alike as one "A" frame, which Python serves batch by batch, the last one
     * partial where they do not fill it; otherwise frames of at most `batchSize` (encodeBatch).
     */
    public static List<Part> encodeRoute(String model, String version, List<Row> requests, int batchSize,
                                         int maxUriChars, long maxInstanceBytes) {
        byte[] joined = requests.size() > batchSize ? encodeAlike(model, version, requests, maxUriChars, maxInstanceBytes) : null;
        if (joined != null) {
            return Collections.singletonList(new Part(requests, joined));
        }
        List<Part> parts = new ArrayList<>();
        for (int from = 0; from < requests.size(); from += batchSize) {
            List<Row> part = requests.size() <= batchSize
                ? requests : new ArrayList<>(requests.subList(from, Math.min(from + batchSize, requests.size())));
            parts.add(new Part(part, encodeBatch(model, version, part, maxUriChars, maxInstanceBytes)));
        }
        return parts;
    }

    /** A request frame and the requests it holds. */
    public static final class Part {
        public final List<Row> requests;
        public final byte[] frame;

        Part(List<Row> requests, byte[] frame) {
            this.requests = requests;
            this.frame = frame;
        }
    }

    /** The "A" frame of a batch of alike requests, as encodeBatch writes it; null when they are not alike. */
    public static byte[] encodeAlike(String model, String version, List<Row> records, int maxUriChars,
                                     long maxInstanceBytes) {
        return alikeFrame("A" + model + "\t" + version, records, maxUriChars, maxInstanceBytes);
    }

    /** A poll frame ('P') or a drain frame ('D'). */
    public static byte[] encodeSignal(char kind) {
        return encode(String.valueOf(kind), Collections.emptyList());
    }

    /** The numbers of the request frames a results frame answers. */
    public static long[] answered(byte[] bytes) {
        ByteBuffer frame = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN);
        long[] numbers = new long[frame.getInt()];
        for (int i = 0; i < numbers.length; i++) {
            numbers[i] = frame.getLong();
        }
        return numbers;
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
            size += 8 + (key == null ? 0 : key.length) + payload(record).length + sourceBytes(record);
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
        putSources(frame, records);
        return frame.array();
    }

    /** The frame of alike requests (see the class comment), or null when they are not alike. */
    private static byte[] alikeFrame(String headerText, List<Row> records, int maxUriChars, long maxInstanceBytes) {
        if (records.isEmpty()) {
            return null;
        }
        byte[] first = payload(records.get(0));
        int layoutAt = layoutAt(first);
        if (layoutAt < 0) {
            return null;
        }
        int layoutLength = ByteBuffer.wrap(first, layoutAt - 4, 4).order(ByteOrder.LITTLE_ENDIAN).getInt();
        int valueSize = first.length - layoutAt - layoutLength;
        if (layoutLength < 0 || valueSize < 0) {
            return null;
        }
        byte[][] uris = new byte[records.size()][];
        long urisBytes = 0;
        for (int i = 0; i < records.size(); i++) {
            Row record = records.get(i);
            String uri = (String) record.getField(0);
            byte[] value = payload(record);
            if (uri == null || uri.isEmpty() || uri.length() > maxUriChars || value.length > maxInstanceBytes
                || field(record, HEADERS) != null) {
                return null;
            }
            byte[] key = uri.getBytes(StandardCharsets.UTF_8);
            int at = layoutAt(value);
            if (at != V2_URI_AT + 4 + key.length || value.length - at != first.length - layoutAt
                || !Arrays.equals(value, V2_URI_AT, V2_URI_AT + key.length, key, 0, key.length)
                || !Arrays.equals(value, at - 4, value.length - valueSize, first, layoutAt - 4, layoutAt + layoutLength)) {
                return null;
            }
            uris[i] = key;
            urisBytes += 4 + key.length;
        }
        byte[] header = headerText.getBytes(StandardCharsets.UTF_8);
        long size = 4L + header.length + 12 + layoutLength + 4 + urisBytes
            + (long) records.size() * (valueSize + PLAIN_SOURCE_BYTES);
        if (size > Integer.MAX_VALUE - 8) {
            return null;
        }
        ByteBuffer frame = ByteBuffer.allocate((int) size).order(ByteOrder.LITTLE_ENDIAN);
        frame.putInt(header.length).put(header).putInt(records.size());
        frame.putInt(layoutLength).put(first, layoutAt, layoutLength).putInt(valueSize);
        frame.putInt((int) urisBytes);
        for (byte[] key : uris) {
            frame.putInt(key.length).put(key);
        }
        for (Row record : records) {
            byte[] value = payload(record);
            frame.put(value, value.length - valueSize, valueSize);
        }
        putSources(frame, records);
        return frame.array();
    }

    /** The sources block of a batch's requests. */
    private static void putSources(ByteBuffer frame, List<Row> records) {
        for (Row record : records) {
            Object partition = field(record, PARTITION);
            Object offset = field(record, OFFSET);
            byte[] headers = (byte[]) field(record, HEADERS);
            frame.putInt(partition == null ? -1 : ((Number) partition).intValue())
                .putLong(offset == null ? -1 : ((Number) offset).longValue());
            frame.putInt(headers == null ? NO_URI : headers.length);
            if (headers != null) {
                frame.put(headers);
            }
        }
    }

    private static long sourceBytes(Row record) {
        byte[] headers = (byte[]) field(record, HEADERS);
        return PLAIN_SOURCE_BYTES + (headers == null ? 0 : headers.length);
    }

    /** A field of a row, null where the row is shorter. */
    static Object field(Row record, int index) {
        return record.getArity() > index ? record.getField(index) : null;
    }

    /** Where a format 2 message's layout starts (after its uint32 length), or -1 when it is not one. */
    private static int layoutAt(byte[] value) {
        if (value.length < V2_URI_AT + 4 || !Arrays.equals(value, 0, 4, V2_MAGIC, 0, 4)) {
            return -1;
        }
        int uriLength = (value[4] & 0xff) | (value[5] & 0xff) << 8;
        int at = V2_URI_AT + uriLength + 4;
        return at <= value.length ? at : -1;
    }

    /**
     * The Row(key, value, headers) records of a results frame (no header), as bytes, the key the
     * uri's UTF-8: its records and alike sections' rows with headers null, its dead letters with
     * their HeaderBlock.
     */
    public static List<Row> decode(byte[] bytes) {
        ByteBuffer frame = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN);
        frame.position(4 + 8 * frame.getInt());
        int count = frame.getInt();
        List<Row> records = new ArrayList<>(count);
        for (int i = 0; i < count; i++) {
            byte[] key = nullableBytes(frame);
            records.add(Row.of(key, bytes(frame, frame.getInt()), null));
        }
        int deadLetters = frame.getInt();
        for (int i = 0; i < deadLetters; i++) {
            byte[] key = nullableBytes(frame);
            byte[] value = bytes(frame, frame.getInt());
            records.add(Row.of(key, value, bytes(frame, frame.getInt())));
        }
        while (frame.hasRemaining()) {
            decodeAlike(bytes, frame, records);
        }
        return records;
    }

    /** One alike section of a results frame: each row becomes its uri's format 2 message. */
    private static void decodeAlike(byte[] bytes, ByteBuffer frame, List<Row> records) {
        int count = frame.getInt();
        int tailAt = frame.position();
        int tailLength = 4 + ByteBuffer.wrap(bytes, tailAt, 4).order(ByteOrder.LITTLE_ENDIAN).getInt();
        frame.position(tailAt + tailLength);
        int rowSize = frame.getInt();
        int urisEnd = frame.getInt() + frame.position();
        int rowAt = urisEnd;
        for (int i = 0; i < count; i++) {
            int uriLength = frame.getInt();
            int uriAt = frame.position();
            byte[] value = new byte[V2_URI_AT + uriLength + tailLength + rowSize];
            System.arraycopy(V2_MAGIC, 0, value, 0, 4);
            value[4] = (byte) uriLength;
            value[5] = (byte) (uriLength >>> 8);
            System.arraycopy(bytes, uriAt, value, V2_URI_AT, uriLength);
            System.arraycopy(bytes, tailAt, value, V2_URI_AT + uriLength, tailLength);
            System.arraycopy(bytes, rowAt, value, V2_URI_AT + uriLength + tailLength, rowSize);
            records.add(Row.of(Arrays.copyOfRange(bytes, uriAt, uriAt + uriLength), value, null));
            frame.position(uriAt + uriLength);
            rowAt += rowSize;
        }
        if (frame.position() != urisEnd) {
            throw new IllegalStateException("an alike section's uris end at byte " + frame.position() + ", not " + urisEnd);
        }
        frame.position(rowAt);
    }

    /** A uint32 length (0xFFFFFFFF: null) and that many bytes. */
    private static byte[] nullableBytes(ByteBuffer frame) {
        int length = frame.getInt();
        return length == NO_URI ? null : bytes(frame, length);
    }

    private static byte[] bytes(ByteBuffer frame, int length) {
        byte[] read = new byte[length];
        frame.get(read);
        return read;
    }

    /** The payload (field 1) of a request or result row; none is an empty one. */
    static byte[] payload(Row record) {
        byte[] value = (byte[]) record.getField(1);
        return value == null ? new byte[0] : value;
    }
}
