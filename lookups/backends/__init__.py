"""The backends lookups call: one object per backend, owning its clients, slots,
guard, meters and health check.

    settings.py        MongoBackendSettings, HttpBackendSettings: [backends.<name>], and
                       the [mongo] / [http] aliases
    base.py            Backend: call() = guard, then a slot per attempt, then the call
    ordered_slots.py   OrderedSlots: a backend's slots, handed out by the calls' places
    mongo.py           MongoBackend: a pymongo client; run(lookup, operation, deadline)
    mongo_errors.py    pymongo's failures made typed, free of the URI
    http.py            HttpBackend: a requests session; get_json(lookup, path, params, deadline)
    collection.py      Backends: every backend of the process, by name

Import from the submodules; this package imports nothing, so that reading the
settings does not load pymongo or requests.
"""
