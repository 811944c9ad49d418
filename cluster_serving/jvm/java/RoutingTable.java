package clusterserving.flink;

import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Pattern;

/**
 * What the micro-batcher routes by: per model name its batch size, max delay and the versions the
 * repository serves, plus the default model and a generation. Parsed from the table text that the
 * Python side writes (conf/repository.py, RoutingTable.text()), UTF-8 lines separated by "\n":
 *
 * <pre>
 * generation TAB default-model-name
 * name TAB batch_size TAB max_delay_ms TAB versions (comma-separated ascending, may be empty)
 * ...
 * </pre>
 *
 * <p>The text also comes from the wire (a control record of the input topic), so parse() checks all
 * of it and throws IllegalArgumentException on anything else; a table is never half taken.
 */
public final class RoutingTable {
    private static final Pattern NAME = Pattern.compile("[A-Za-z0-9][A-Za-z0-9_.-]{0,63}");
    public static final int MAX_BATCH_SIZE = 65536;
    public static final long MAX_DELAY_MS = 60_000;

    /** One model's batching and the versions the repository serves of it. */
    public static final class Entry {
        public final int batchSize;
        public final long maxDelayMs;
        public final long[] versions;

        Entry(int batchSize, long maxDelayMs, long[] versions) {
            this.batchSize = batchSize;
            this.maxDelayMs = maxDelayMs;
            this.versions = versions;
        }
    }

    public final long generation;
    public final String defaultModel;
    public final Map<String, Entry> entries;
    public final String text;

    private RoutingTable(long generation, String defaultModel, Map<String, Entry> entries, String text) {
        this.generation = generation;
        this.defaultModel = defaultModel;
        this.entries = Collections.unmodifiableMap(entries);
        this.text = text;
    }

    /** The table of `text`; IllegalArgumentException saying what is wrong when it is not one. */
    public static RoutingTable parse(String text) {
        if (text == null) {
            throw new IllegalArgumentException("no table text");
        }
        String[] lines = text.split("\n", -1);
        int count = lines.length;
        if (count > 1 && lines[count - 1].isEmpty()) {
            count--; // one final newline
        }
        String[] head = lines[0].split("\t", -1);
        if (head.length != 2) {
            throw new IllegalArgumentException("the first line is not 'generation TAB default model'");
        }
        long generation = number(head[0], 1, Long.MAX_VALUE, "generation");
        String defaultModel = head[1];
        Map<String, Entry> entries = new LinkedHashMap<>();
        for (int i = 1; i < count; i++) {
            String[] fields = lines[i].split("\t", -1);
            if (fields.length != 4) {
                throw new IllegalArgumentException("line " + (i + 1) + " has " + fields.length + " fields, not 4");
            }
            String name = name(fields[0], "line " + (i + 1));
            int batchSize = (int) number(fields[1], 1, MAX_BATCH_SIZE, "batch_size of " + name);
            long maxDelayMs = number(fields[2], 0, MAX_DELAY_MS, "max_delay_ms of " + name);
            if (entries.put(name, new Entry(batchSize, maxDelayMs, versions(fields[3], name))) != null) {
                throw new IllegalArgumentException("model " + name + " has two lines");
            }
        }
        if (!entries.containsKey(name(defaultModel, "the default model"))) {
            throw new IllegalArgumentException("the default model " + defaultModel + " has no line");
        }
        return new RoutingTable(generation, defaultModel, entries, text);
    }

    /** The entry that batches requests for `model`: its own, else the default model's ("" or null: the default). */
    public Entry entryFor(String model) {
        Entry entry = model == null || model.isEmpty() ? null : entries.get(model);
        return entry != null ? entry : entries.get(defaultModel);
    }

    private static String name(String name, String what) {
        if (!NAME.matcher(name).matches()) {
            throw new IllegalArgumentException(what + ": '" + shortened(name) + "' is not a model name");
        }
        return name;
    }

    private static long[] versions(String field, String name) {
        if (field.isEmpty()) {
            return new long[0];
        }
        String[] parts = field.split(",", -1);
        long[] versions = new long[parts.length];
        for (int i = 0; i < parts.length; i++) {
            versions[i] = number(parts[i], 1, Long.MAX_VALUE, "a version of " + name);
            if (i > 0 && versions[i] <= versions[i - 1]) {
                throw new IllegalArgumentException("the versions of " + name + " are not ascending");
            }
        }
        return versions;
    }

    /** A decimal number (digits only) from `min` to `max`. */
    private static long number(String field, long min, long max, String what) {
        long value;
        try {
            if (field.isEmpty() || field.length() > 19 || !field.chars().allMatch(c -> c >= '0' && c <= '9')) {
                throw new NumberFormatException();
            }
            value = Long.parseLong(field);
        } catch (NumberFormatException e) {
            throw new IllegalArgumentException(what + ": '" + shortened(field) + "' is not a number");
        }
        if (value < min || value > max) {
            throw new IllegalArgumentException(what + ": " + value + " is not in " + min + ".." + max);
        }
        return value;
    }

    private static String shortened(String text) {
        return text.length() <= 40 ? text : text.substring(0, 40) + "...";
    }
}
