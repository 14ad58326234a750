"""Pure room rules: no threads, no sockets, no engine calls, no clock reads.

Everything here takes `now` (seconds, monotonic) from its caller and returns
values or actions; the drivers that own threads and sockets live elsewhere.
"""
