/* The framed-wire data path's receiving side: a native listener that lands LAYER bytes in registered memory. */
#ifndef EPD_WIRE_LISTENER_H
#define EPD_WIRE_LISTENER_H

#include "epd.h"

/* Most layers one PREFILL may announce (embedding, deepstack, and room to grow). */
#define EPD_WIRE_MAX_LAYERS 16
/* Largest PREFILL (or FIRST) payload the listener reads: the Msg is a few hundred bytes. */
#define EPD_WIRE_MAX_CONTROL ((size_t)64 << 10)

PyObject *epd_py_wire_listen(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *epd_py_wire_listener_port(PyObject *self, PyObject *cap);
PyObject *epd_py_wire_add_region(PyObject *self, PyObject *args);
PyObject *epd_py_wire_remove_region(PyObject *self, PyObject *args);
PyObject *epd_py_wire_listener_stats(PyObject *self, PyObject *cap);
PyObject *epd_py_wire_listener_close(PyObject *self, PyObject *cap);

/* Entries for the module's method table (module.c). */
#define EPD_WIRE_METHODS                                                                                  \
    /* METH_KEYWORDS functions are stored as PyCFunction; via void (*)(void) the cast draws no warning. */ \
    {"wire_listen", (PyCFunction)(void (*)(void))epd_py_wire_listen, METH_VARARGS | METH_KEYWORDS,       \
     "wire_listen(host, port, recv_timeout, idle_timeout, chunk_limit, max_conns, min_rate=262144.0, "    \
     "rate_grace=-1.0, first_byte_timeout=-1.0, evict_after=1.0) -> listener. A transfer must average "   \
     "min_rate bytes/s (0: no bound) once it has run rate_grace seconds (negative: 2 * recv_timeout). "   \
     "A new connection that sends nothing for first_byte_timeout seconds (negative: 10; at most "         \
     "idle_timeout) is closed. With every slot taken, a new connection closes the one furthest behind "   \
     "the rate, once it is evict_after seconds behind (negative: never)."},                               \
    {"wire_listener_port", epd_py_wire_listener_port, METH_O, "wire_listener_port(listener) -> int."},   \
    {"wire_add_region", epd_py_wire_add_region, METH_VARARGS, "wire_add_region(listener, addr, len)."},  \
    {"wire_remove_region", epd_py_wire_remove_region, METH_VARARGS,                                      \
     "wire_remove_region(listener, addr) -> len; waits for copies into it."},                             \
    {"wire_listener_stats", epd_py_wire_listener_stats, METH_O, "wire_listener_stats(listener) -> dict."}, \
    {"wire_listener_close", epd_py_wire_listener_close, METH_O,                                          \
     "wire_listener_close(listener): stops and joins every thread; idempotent."},

#endif
