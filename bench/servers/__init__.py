"""The light servers a benchmark stack runs: a MongoDB-wire responder replaying recorded
answers (and the recorder), nx-27017 seeded, the lean HTTP backend, and an OTLP sink."""
