"""Drivers: the threads, sockets, engine calls and clock that carry out the pure cores' actions."""
