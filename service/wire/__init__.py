"""Everything between bytes on a socket and a decoded call.

    accept.py    the accept loop that pauses, instead of failing, without file descriptors
    formats.py   the transports and protocols, named once
    tls.py       the optional TLS listener and client contexts
    certificates.py  the listener's context, rebuilt when its files change
    channel.py   one connection's framing: idle and frame timeouts, bounded reads and writes
    scan.py      every message checked against the size limits before any decoder runs,
                 with its per-protocol walkers binary.py and compact.py (shared: walk.py)
    codec.py     decoding a checked message from a hard-ended source; encoding replies
    errors.py    MessageRejected and its kinds

Nothing here knows the AppStats methods; the server hands decoded calls to the handler.
"""
