package clusterserving.flink;

import java.io.ByteArrayOutputStream;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.Set;
// The connector jar carries kafka-clients relocated under org.apache.flink.kafka.shaded.
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.Header;
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.Headers;
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.internals.RecordHeaders;

/**
 * Kafka record headers as one byte array, the way they cross to Python and back
 * (cluster_serving/runtime/frames.py reads and writes the same), little-endian: a uint32 count,
 * then per header a uint32 name length, the UTF-8 name, a uint32 value length (0xFFFFFFFF: a null
 * value) and the value. A request's headers go to Python so that it can read its deadline and
 * keep them on a dead letter; a dead letter's come back this way.
 */
public final class HeaderBlock {
    private static final int NO_VALUE = -1;

    private HeaderBlock() {}

    /** The headers whose names are not in `skipped`, or null when there are none. */
    public static byte[] encode(Headers headers, Set<String> skipped) {
        if (!hasOthers(headers, skipped)) {
            return null;
        }
        ByteArrayOutputStream block = new ByteArrayOutputStream();
        writeInt(block, 0);  // the count, set below
        int count = 0;
        for (Header header : headers) {
            if (skipped.contains(header.key())) {
                continue;
            }
            byte[] name = header.key().getBytes(StandardCharsets.UTF_8);
            byte[] value = header.value();
            writeInt(block, name.length);
            block.writeBytes(name);
            writeInt(block, value == null ? NO_VALUE : value.length);
            if (value != null) {
                block.writeBytes(value);
            }
            count++;
        }
        byte[] bytes = block.toByteArray();
        ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN).putInt(0, count);
        return bytes;
    }

    private static boolean hasOthers(Headers headers, Set<String> skipped) {
        for (Header header : headers) {
            if (!skipped.contains(header.key())) {
                return true;
            }
        }
        return false;
    }

    /** The headers of a block. */
    public static Headers decode(byte[] block) {
        ByteBuffer buffer = ByteBuffer.wrap(block).order(ByteOrder.LITTLE_ENDIAN);
        RecordHeaders headers = new RecordHeaders();
        int count = buffer.getInt();
        for (int i = 0; i < count; i++) {
            byte[] name = new byte[buffer.getInt()];
            buffer.get(name);
            int length = buffer.getInt();
            byte[] value = null;
            if (length != NO_VALUE) {
                value = new byte[length];
                buffer.get(value);
            }
            headers.add(new String(name, StandardCharsets.UTF_8), value);
        }
        if (buffer.hasRemaining()) {
            throw new IllegalStateException("a header block of " + count + " headers has " + buffer.remaining() + " bytes more");
        }
        return headers;
    }

    private static void writeInt(ByteArrayOutputStream out, int value) {
        out.write(value);
        out.write(value >>> 8);
        out.write(value >>> 16);
        out.write(value >>> 24);
    }
}
