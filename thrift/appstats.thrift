/*
 * Fanout wire contract: one application's dashboard panels, gathered in parallel.
 *
 * Compatibility rules: never renumber or retype a field; add fields and methods
 * only as optional additions. Times on the wire are epoch milliseconds and every
 * duration says its unit in its name (deadline_ms, elapsed_ms).
 *
 * Default transport: framed; default protocol: binary. Buffered transport and
 * compact protocol are server options; any Apache Thrift client using the same
 * settings interoperates.
 */

namespace py appstats
namespace java com.example.fanout.appstats
namespace go appstats

/** What happened to one requested panel. */
enum TaskStatus {
  OK = 0,         // gathered; its data is in StatsResponse.panels
  ERROR = 1,      // the lookup failed; see error_type, message, retryable
  TIMEOUT = 2,    // the task's budget or the request deadline ran out
  CANCELLED = 3,  // stopped because a required sibling failed
  REJECTED = 4,   // no pool slot became free in time
  SKIPPED = 5     // not run: the lookup is disabled on this server, or shed under load
                  // (error_type "Brownout", retryable)
}

/** How much a call matters when the server must shed load; the least critical is shed
    first (optional panels before whole calls). Optional addition. */
enum Criticality {
  CRITICAL_PLUS = 0,   // never shed before anything else: a user's action that must work
  CRITICAL = 1,        // a user waits for it (the default: a call that says nothing)
  SHEDDABLE_PLUS = 2,  // a user may see it late: shed after SHEDDABLE
  SHEDDABLE = 3        // nobody waits: prefetch, batch, a background refresh
}

/** Caller-side metadata: trace context, remaining budget, correlation id. */
struct RequestMeta {
  /** W3C trace context from the caller: traceparent, tracestate, baggage. */
  1: optional map<string, string> headers
  /** The caller's remaining budget in milliseconds. */
  2: optional i32 deadline_ms
  /** The caller's id for this request, echoed in logs and spans. */
  3: optional string request_id
  /** How much this call matters under overload; absent means CRITICAL. Optional addition. */
  4: optional Criticality criticality
  /** true: an answer that reads no cached bucket (the manual's "Results cache" how-to,
   *  docs/how-to/results-cache.md); absent means false. Optional addition. */
  5: optional bool fresh
  /** Who is calling (a product, a job), for fair share under overload: 1-128 characters
   *  of letters, digits and . _ : / @ -. A mutual-TLS client certificate's name takes
   *  precedence; absent means one shared anonymous caller. A name serves fairness, not
   *  security. Optional addition. */
  6: optional string caller
}

/** One dashboard request: an application over the half-open window [start_ms, end_ms). */
struct StatsRequest {
  1: required string app
  2: required i64 start_ms
  3: required i64 end_ms
  /** Panel names to gather; all panels the server offers when absent. */
  4: optional list<string> panels
  5: optional RequestMeta meta
}

struct TaskOutcome {
  1: string name
  2: string source
  3: TaskStatus status
  4: double elapsed_ms
  5: optional string error_type
  6: optional string message
  /** True when the same call may succeed if tried again later. */
  7: bool retryable
}

struct MessageCount {
  1: string message
  2: i64 count
}

/** Total errors in the window and the most frequent messages. */
struct ErrorSummary {
  1: i64 total
  2: list<MessageCount> top
}

struct TopEntry {
  1: string key
  2: i64 count
  3: double mean_ms
  4: double total_ms
}

/** The largest entries (at most 10), ties broken by key. */
struct TopList {
  1: list<TopEntry> entries
}

struct Point {
  1: i64 ts_ms
  2: double value
}

struct Series {
  1: list<Point> points
  2: optional i64 step_ms
}

struct Alert {
  1: string id
  2: string severity
  3: string title
  4: i64 triggered_ms
}

struct AlertList {
  1: list<Alert> alerts
}

/** One panel's data; exactly one member is set. */
union PanelData {
  1: ErrorSummary error_summary
  2: TopList top_list
  3: Series series
  4: AlertList alert_list
}

struct StatsResponse {
  1: string app
  /** The panels that succeeded, by panel name. */
  2: map<string, PanelData> panels
  /** One entry per requested panel, whatever happened to it. */
  3: list<TaskOutcome> outcomes
  /** The request's trace id in lowercase hex (32 digits), empty if untraced. */
  4: string trace_id
  5: double elapsed_ms
}

/** The request is malformed; `field` names the offending field. Do not retry unchanged. */
exception InvalidRequest {
  1: string message
  2: optional string field
}

/** The server cannot take this work now; retry after retry_after_ms. */
exception Overloaded {
  1: string message
  2: optional i32 retry_after_ms
}

/**
 * A required panel failed, so the response would be incomplete in a way the
 * caller declared unacceptable. `outcomes` says what happened to every panel.
 * Optional addition: declared so callers can tell it from transport errors.
 */
exception PanelFailed {
  1: string message
  2: optional string panel
  3: optional list<TaskOutcome> outcomes
}

/** Whether the server takes new calls. Optional addition, for load balancers. */
enum ServingState {
  SERVING = 0,    // accepting and answering calls
  DRAINING = 1    // shutting down: finishing calls in flight, accepting no new connections
}

/** One backend as the server last saw it. */
struct BackendHealth {
  /** The backend's name: "mongo", "alerts", "metrics". */
  1: string name
  2: bool up
  /** How long the check took, in milliseconds. */
  3: double latency_ms
  /** Why the backend is down (never credentials); empty when up. */
  4: optional string detail
  /** Its circuit breaker: "closed", "open" (failing fast) or "half_open" (probing). Optional addition. */
  5: optional string circuit
}

/** Answer of health(): the serving state and each backend's. Optional addition. */
struct Health {
  1: ServingState state
  2: list<BackendHealth> backends
}

/**
 * One pool of slots over the server's rolling window (window_s seconds).
 * recommended = offered_per_s x hold_ms x headroom (Little's law). Optional addition.
 */
struct PoolStats {
  /** "fanout.request", "fanout.tasks", then each backend by name: "mongo", "alerts", "metrics", ... */
  1: string name
  2: i32 size
  3: i32 in_use
  /** 99th percentile of slots taken, as arrivals saw them. */
  4: i32 in_use_p99
  /** 99th percentile of the wait for a slot, in milliseconds. */
  5: double wait_p99_ms
  /** Attempts to take a slot per second, including those that waited in vain. */
  6: double offered_per_s
  /** Mean time a slot was held, in milliseconds. */
  7: double hold_ms
  /** Takers that gave up waiting. */
  8: i64 timeouts
  9: i32 recommended
  10: double window_s
  /** What is short, when takers waited: "slots" (recommended is bigger than size), or "cpu"
      (the process saturated its core, so more slots would not help; recommended stays at size).
      Empty when nothing is short. Optional addition. */
  11: optional string limited_by
}

/** One caller's fair share of admission's limit and its use, for `fanout pools`: a label
    of the callers' metrics (a configured caller, one of the first names seen, or "other"
    for the rest). Optional addition. */
struct CallerShareStats {
  /** A client certificate's name, a RequestMeta.caller, "anonymous" or "other". */
  1: string caller
  2: double weight
  /** Its share of the limit now: limit x weight / the active callers' weights (0: not active). */
  3: double share
  4: i32 calls_in_flight
  /** Calls admitted and answered Overloaded since start. */
  5: i64 admitted
  6: i64 refused
}

/** One worker's pools in a pre-forked group: the fields of PoolReport, and its slot. Optional addition. */
struct WorkerPools {
  1: string worker
  2: list<PoolStats> pools
  3: i32 admission_limit
  4: i32 calls_in_flight
  5: i32 calls_queued
  6: optional i64 tasks_started
  7: optional i64 tasks_coalesced
  /** As in PoolReport. Optional addition. */
  8: optional double brownout_level
  9: optional double brownout_peak
  10: optional i64 calls_lighter
  11: optional i64 calls_shed
  /** As in PoolReport. Optional addition. */
  12: optional i64 cache_hits
  13: optional i64 cache_misses
  14: optional i64 cache_evictions
  15: optional i64 cache_bytes
  16: optional i64 cache_max_bytes
  /** As in PoolReport. Optional addition. */
  17: optional list<CallerShareStats> callers
}

/** Answer of pool_stats(): every pool, and the adaptive admission limit. Optional addition. */
struct PoolReport {
  1: list<PoolStats> pools
  /** The adaptive limit on calls in flight, and the calls in flight and queued now. */
  2: i32 admission_limit
  3: i32 calls_in_flight
  4: i32 calls_queued
  /** Fan-out tasks started since the server started, and those of them that shared an
      identical lookup's call in flight instead of calling (request coalescing). Optional addition. */
  5: optional i64 tasks_started
  6: optional i64 tasks_coalesced
  /** With pre-forked workers (server.workers > 1): the worker that answered, and each
      serving worker's own report; the fields above are then the group's (sizes, use,
      arrivals and recommendations added up; waits and percentiles the largest). Optional addition. */
  7: optional string worker
  8: optional list<WorkerPools> workers
  /** Brownout: the dimmer's level now and its highest over the pools' window (0: nothing
      shed, 1: all that may be shed), and over that window the calls it answered lighter
      (optional panels not run) and those it refused. Optional addition. */
  9: optional double brownout_level
  10: optional double brownout_peak
  11: optional i64 calls_lighter
  12: optional i64 calls_shed
  /** The results cache, when enabled: buckets read and missed, and evicted, since start;
      the bytes this process holds and its bound (0 where the buckets are in Redis).
      Optional addition. */
  13: optional i64 cache_hits
  14: optional i64 cache_misses
  15: optional i64 cache_evictions
  16: optional i64 cache_bytes
  17: optional i64 cache_max_bytes
  /** Fair share: each caller label's share of the admission limit and its use, the
      busiest first. Optional addition. */
  18: optional list<CallerShareStats> callers
}

/** One panel this server offers, for panel_info(). Optional addition. */
struct PanelInfo {
  1: string name
  2: string source
  /** True when the panel may be shed under load (brownout) before any call is refused. */
  3: bool is_optional
  /** True when the panel failing fails the whole call (PanelFailed). */
  4: bool is_required
}

service AppStats {
  string ping()
  /** Serving state and backend reachability, for load balancers. Optional addition. */
  Health health()
  /** Names of the panels this server can gather. */
  list<string> panels()
  StatsResponse get_app_stats(1: StatsRequest request)
    throws (1: InvalidRequest invalid, 2: Overloaded overloaded, 3: PanelFailed failed)
  /** How full each pool is and what size it should be, for `fanout pools`. Optional addition. */
  PoolReport pool_stats()
  /** The panels panels() names, in the same order, each with whether it is optional.
      Optional addition: panels() keeps its type for the clients that call it. */
  list<PanelInfo> panel_info()
}
