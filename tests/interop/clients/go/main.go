// An Apache Thrift Go client of AppStats, generated from thrift/appstats.thrift
// (into ./appstats by `make interop`). Usage: client HOST PORT TRANSPORT PROTOCOL TRACEPARENT.
// Prints what it got as one JSON object; the Python side checks it.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"interop/appstats"
)

func main() {
	if len(os.Args) != 6 {
		fail(errors.New("usage: client HOST PORT TRANSPORT PROTOCOL TRACEPARENT"))
	}
	host, port, transportName, protocolName, traceparent := os.Args[1], os.Args[2], os.Args[3], os.Args[4], os.Args[5]
	conf := &thrift.TConfiguration{ConnectTimeout: 5 * time.Second, SocketTimeout: 10 * time.Second}
	var transport thrift.TTransport = thrift.NewTSocketConf(net.JoinHostPort(host, port), conf)
	if transportName == "framed" {
		transport = thrift.NewTFramedTransportConf(transport, conf)
	} else {
		transport = thrift.NewTBufferedTransport(transport, 8192)
	}
	var protocol thrift.TProtocol
	if protocolName == "compact" {
		protocol = thrift.NewTCompactProtocolConf(transport, conf)
	} else {
		protocol = thrift.NewTBinaryProtocolConf(transport, conf)
	}
	if err := transport.Open(); err != nil {
		fail(err)
	}
	defer transport.Close()
	client := appstats.NewAppStatsClient(thrift.NewTStandardClient(protocol, protocol))
	ctx := context.Background()
	report := map[string]interface{}{"client": "go"}

	pong, err := client.Ping(ctx)
	check(err)
	report["ping"] = pong
	panels, err := client.Panels(ctx)
	check(err)
	report["panels"] = panels

	request := appstats.NewStatsRequest()
	request.App = "shop"
	request.StartMs, request.EndMs = 1_700_000_000_000, 1_700_003_600_000
	deadline := int32(5000)
	caller := "interop-go" // who calls, for the server's fair share
	request.Meta = &appstats.RequestMeta{Headers: map[string]string{"traceparent": traceparent}, DeadlineMs: &deadline, Caller: &caller}
	response, err := client.GetAppStats(ctx, request)
	check(err)
	report["app"] = response.App
	report["trace_id"] = response.TraceID
	statuses := map[string]string{}
	for _, outcome := range response.Outcomes {
		statuses[outcome.Name] = outcome.Status.String()
	}
	report["statuses"] = statuses
	kinds := map[string]string{}
	for name, data := range response.Panels {
		kinds[name] = panelKind(data)
	}
	report["panel_kinds"] = kinds

	// The same call, SHEDDABLE: what may be shed first under overload.
	sheddable := appstats.NewStatsRequest()
	sheddable.App = "shop"
	sheddable.StartMs, sheddable.EndMs = request.StartMs, request.EndMs
	criticality := appstats.Criticality_SHEDDABLE
	sheddable.Meta = &appstats.RequestMeta{DeadlineMs: &deadline, Criticality: &criticality}
	shed, err := client.GetAppStats(ctx, sheddable)
	check(err)
	shedOutcomes := map[string]string{}
	for _, outcome := range shed.Outcomes {
		shedOutcomes[outcome.Name] = outcome.Status.String() + " " + outcome.GetErrorType()
	}
	report["sheddable"] = shedOutcomes

	// Two whole hours, asking for a fresh answer: the server reads and keeps no cached bucket.
	fresh := appstats.NewStatsRequest()
	fresh.App = "shop"
	fresh.StartMs, fresh.EndMs = 1_699_999_200_000, 1_700_006_400_000
	yes := true
	fresh.Meta = &appstats.RequestMeta{DeadlineMs: &deadline, Fresh: &yes}
	freshResponse, err := client.GetAppStats(ctx, fresh)
	check(err)
	report["fresh_outcomes"] = len(freshResponse.Outcomes)

	bad := appstats.NewStatsRequest()
	bad.StartMs, bad.EndMs = 1, 2
	_, err = client.GetAppStats(ctx, bad)
	var invalid *appstats.InvalidRequest
	if !errors.As(err, &invalid) {
		fail(fmt.Errorf("an empty app: expected InvalidRequest, got %v", err))
	}
	report["invalid_field"] = invalid.GetField()

	health, err := client.Health(ctx)
	check(err)
	report["health_state"] = health.State.String()
	names := []string{}
	for _, backend := range health.Backends {
		names = append(names, backend.Name)
	}
	sort.Strings(names)
	report["health_backends"] = strings.Join(names, ",")

	out, _ := json.Marshal(report)
	fmt.Println(string(out))
}

func panelKind(data *appstats.PanelData) string {
	switch {
	case data.IsSetErrorSummary():
		return "error_summary"
	case data.IsSetTopList():
		return "top_list"
	case data.IsSetSeries():
		return "series"
	case data.IsSetAlertList():
		return "alert_list"
	}
	return "none"
}

func check(err error) {
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "go client:", err)
	os.Exit(1)
}
