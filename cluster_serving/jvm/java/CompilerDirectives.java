package clusterserving.flink;

import java.lang.management.ManagementFactory;
import javax.management.ObjectName;

/**
 * HotSpot's compiler directives, added to the running JVM as `jcmd <pid> Compiler.directives_add`
 * adds them, through the DiagnosticCommand MBean: the job process calls it over py4j once its
 * warm-up is done (flink.jit_after_warm_up).
 */
public final class CompilerDirectives {
    private CompilerDirectives() {}

    /** Adds the directives of the JSON file at `path`; returns what the JVM answered. */
    public static String add(String path) throws Exception {
        Object answer = ManagementFactory.getPlatformMBeanServer().invoke(
                new ObjectName("com.sun.management:type=DiagnosticCommand"), "compilerDirectivesAdd",
                new Object[] {new String[] {path}}, new String[] {String[].class.getName()});
        return String.valueOf(answer);
    }
}
