// An Apache Thrift Java client of AppStats, generated from thrift/appstats.thrift by
// `make interop`. Usage: Client HOST PORT TRANSPORT PROTOCOL TRACEPARENT.
// Prints what it got as one JSON object; the Python side checks it.
import com.example.fanout.appstats.AppStats;
import com.example.fanout.appstats.BackendHealth;
import com.example.fanout.appstats.Criticality;
import com.example.fanout.appstats.Health;
import com.example.fanout.appstats.InvalidRequest;
import com.example.fanout.appstats.PanelData;
import com.example.fanout.appstats.RequestMeta;
import com.example.fanout.appstats.StatsRequest;
import com.example.fanout.appstats.StatsResponse;
import com.example.fanout.appstats.TaskOutcome;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import org.apache.thrift.protocol.TBinaryProtocol;
import org.apache.thrift.protocol.TCompactProtocol;
import org.apache.thrift.protocol.TProtocol;
import org.apache.thrift.transport.TSocket;
import org.apache.thrift.transport.TTransport;
import org.apache.thrift.transport.layered.TFramedTransport;

public final class Client {
  public static void main(String[] args) throws Exception {
    if (args.length != 5) {
      System.err.println("usage: Client HOST PORT TRANSPORT PROTOCOL TRACEPARENT");
      System.exit(2);
    }
    // TSocket buffers its own streams: it is Java's "buffered" transport.
    TTransport transport = new TSocket(args[0], Integer.parseInt(args[1]), 10_000);
    if (args[2].equals("framed")) {
      transport = new TFramedTransport(transport);
    }
    TProtocol protocol = args[3].equals("compact")
        ? new TCompactProtocol(transport) : new TBinaryProtocol(transport);
    transport.open();
    try {
      AppStats.Client client = new AppStats.Client(protocol);
      Map<String, Object> report = new TreeMap<>();
      report.put("client", "java");
      report.put("ping", client.ping());
      report.put("panels", client.panels());

      StatsRequest request = new StatsRequest("shop", 1_700_000_000_000L, 1_700_003_600_000L);
      // The caller names itself, for the server's fair share.
      request.setMeta(new RequestMeta().setHeaders(Map.of("traceparent", args[4])).setDeadline_ms(5000)
          .setCaller("interop-java"));
      StatsResponse response = client.get_app_stats(request);
      report.put("app", response.getApp());
      report.put("trace_id", response.getTrace_id());
      Map<String, Object> statuses = new TreeMap<>();
      for (TaskOutcome outcome : response.getOutcomes()) {
        statuses.put(outcome.getName(), outcome.getStatus().name());
      }
      report.put("statuses", statuses);
      Map<String, Object> kinds = new TreeMap<>();
      for (Map.Entry<String, PanelData> panel : response.getPanels().entrySet()) {
        kinds.put(panel.getKey(), panel.getValue().getSetField().getFieldName());
      }
      report.put("panel_kinds", kinds);

      // The same call, SHEDDABLE: what may be shed first under overload.
      StatsRequest sheddable = new StatsRequest("shop", 1_700_000_000_000L, 1_700_003_600_000L);
      sheddable.setMeta(new RequestMeta().setDeadline_ms(5000).setCriticality(Criticality.SHEDDABLE));
      Map<String, Object> shed = new TreeMap<>();
      for (TaskOutcome outcome : client.get_app_stats(sheddable).getOutcomes()) {
        shed.put(outcome.getName(), outcome.getStatus().name() + " "
            + (outcome.isSetError_type() ? outcome.getError_type() : ""));
      }
      report.put("sheddable", shed);

      // Two whole hours, asking for a fresh answer: the server reads and keeps no cached bucket.
      StatsRequest fresh = new StatsRequest("shop", 1_699_999_200_000L, 1_700_006_400_000L);
      fresh.setMeta(new RequestMeta().setDeadline_ms(5000).setFresh(true));
      report.put("fresh_outcomes", client.get_app_stats(fresh).getOutcomes().size());

      try {
        client.get_app_stats(new StatsRequest("", 1L, 2L));
        throw new AssertionError("an empty app: expected InvalidRequest");
      } catch (InvalidRequest invalid) {
        report.put("invalid_field", invalid.getField());
      }

      Health health = client.health();
      report.put("health_state", health.getState().name());
      List<String> names = new ArrayList<>();
      for (BackendHealth backend : health.getBackends()) {
        names.add(backend.getName());
      }
      Collections.sort(names);
      report.put("health_backends", String.join(",", names));
      System.out.println(toJson(report));
    } finally {
      transport.close();
    }
  }

  private static String toJson(Object value) {
    if (value instanceof Map<?, ?> map) {
      List<String> parts = new ArrayList<>();
      for (Map.Entry<?, ?> entry : map.entrySet()) {
        parts.add(toJson(entry.getKey().toString()) + ":" + toJson(entry.getValue()));
      }
      return "{" + String.join(",", parts) + "}";
    }
    if (value instanceof List<?> list) {
      List<String> parts = new ArrayList<>();
      for (Object item : list) {
        parts.add(toJson(item));
      }
      return "[" + String.join(",", parts) + "]";
    }
    String text = String.valueOf(value);
    StringBuilder quoted = new StringBuilder("\"");
    for (char c : text.toCharArray()) {
      if (c == '"' || c == '\\') {
        quoted.append('\\').append(c);
      } else if (c < 0x20) {
        quoted.append(String.format("\\u%04x", (int) c));
      } else {
        quoted.append(c);
      }
    }
    return quoted.append('"').toString();
  }
}
