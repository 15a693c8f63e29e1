// An Apache Thrift Node client of AppStats, generated from thrift/appstats.thrift
// (into ./gen-nodejs by `make interop`). Usage: node client.js HOST PORT TRANSPORT PROTOCOL TRACEPARENT.
// Prints what it got as one JSON object; the Python side checks it.
'use strict';

const path = require('path');
const thrift = require('thrift');

const generated = process.env.APPSTATS_GEN || path.join(__dirname, 'gen-nodejs');
const AppStats = require(path.join(generated, 'AppStats'));
const types = require(path.join(generated, 'appstats_types'));

async function main([host, port, transportName, protocolName, traceparent]) {
  const connection = thrift.createConnection(host, Number(port), {
    transport: transportName === 'framed' ? thrift.TFramedTransport : thrift.TBufferedTransport,
    protocol: protocolName === 'compact' ? thrift.TCompactProtocol : thrift.TBinaryProtocol,
    connect_timeout: 5000,
    timeout: 10000,
  });
  connection.on('error', (error) => fail(error));
  const client = thrift.createClient(AppStats, connection);
  const report = { client: 'node' };
  try {
    report.ping = await client.ping();
    report.panels = await client.panels();

    const response = await client.get_app_stats(new types.StatsRequest({
      app: 'shop', start_ms: 1700000000000, end_ms: 1700003600000,
      // The caller names itself, for the server's fair share.
      meta: new types.RequestMeta({ headers: { traceparent }, deadline_ms: 5000, caller: 'interop-node' }),
    }));
    report.app = response.app;
    report.trace_id = response.trace_id;
    report.statuses = {};
    const statusNames = Object.fromEntries(Object.entries(types.TaskStatus).map(([k, v]) => [v, k]));
    for (const outcome of response.outcomes) report.statuses[outcome.name] = statusNames[outcome.status];
    report.panel_kinds = {};
    for (const [name, data] of Object.entries(response.panels)) {
      report.panel_kinds[name] = Object.keys(data).find((key) => data[key] !== null) || 'none';
    }

    // The same call, SHEDDABLE: what may be shed first under overload.
    const shed = await client.get_app_stats(new types.StatsRequest({
      app: 'shop', start_ms: 1700000000000, end_ms: 1700003600000,
      meta: new types.RequestMeta({ deadline_ms: 5000, criticality: types.Criticality.SHEDDABLE }),
    }));
    report.sheddable = {};
    for (const outcome of shed.outcomes) {
      report.sheddable[outcome.name] = `${statusNames[outcome.status]} ${outcome.error_type || ''}`;
    }

    // Two whole hours, asking for a fresh answer: the server reads and keeps no cached bucket.
    const fresh = await client.get_app_stats(new types.StatsRequest({
      app: 'shop', start_ms: 1699999200000, end_ms: 1700006400000,
      meta: new types.RequestMeta({ deadline_ms: 5000, fresh: true }),
    }));
    report.fresh_outcomes = fresh.outcomes.length;

    try {
      await client.get_app_stats(new types.StatsRequest({ app: '', start_ms: 1, end_ms: 2 }));
      throw new Error('an empty app: expected InvalidRequest');
    } catch (error) {
      if (!(error instanceof types.InvalidRequest)) throw error;
      report.invalid_field = error.field;
    }

    const health = await client.health();
    const stateNames = Object.fromEntries(Object.entries(types.ServingState).map(([k, v]) => [v, k]));
    report.health_state = stateNames[health.state];
    report.health_backends = health.backends.map((b) => b.name).sort().join(',');
    console.log(JSON.stringify(report));
  } finally {
    connection.end();
  }
}

function fail(error) {
  console.error('node client:', error && error.stack ? error.stack : error);
  process.exit(1);
}

main(process.argv.slice(2)).catch(fail);
