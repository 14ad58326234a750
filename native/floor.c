/* The bench's floor path with its loops in C: what a control plane over ZMQ and Mooncake costs
 * with nothing but its calls, none of them made from Python.
 *
 * `epd-transfer bench --paths cfloor` runs these on its rank processes' main threads, the GIL
 * released, on the sockets pyzmq opened (zmqmsg.c's libzmq functions) and the engine the
 * Mooncake binding started (mooncake.c's calls): the very messages, writes and poll schedule
 * of its Python `floor` path (transfer/bench.py), so the two side by side say what the Python
 * around the same calls costs, and the `cfloor` rows what a native hot path would start from.
 * A prefill rank keeps its asks out (24 bytes: i64 room, i64 prefill rank, u64 destination,
 * little-endian); the encode rank writes the shard an ask names at once, polls the write as the
 * sender pool's schedule says (transfer/core/polls.py) and pushes an 8-byte status (the room).
 */
#include "epd.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ASK_BYTES 24
#define STATUS_BYTES 8
#define SHORT_WRITE_BYTES ((uint64_t)1 << 20)
#define SHORT_WRITE_S 2e-3
#define MAX_RECEIVERS 64
#define MAX_FLIGHTS 4096
#define DETAIL_BYTES 256
/* The most item starts: room % starts times step % starts must fit an int64. */
#define MAX_STARTS ((int64_t)1 << 31)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Sleeps until fd is readable or `seconds` passed (a signal may end it early). */
static void sleep_on(int fd, double seconds)
{
    struct pollfd p = {fd, POLLIN, 0};
    if (seconds < 0)
        seconds = 0;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    ppoll(&p, 1, &ts, NULL);
}

/* One message sent, waiting out a full queue for at most `bound_s`: 0, or -1 with the errno in *err. */
static int send_bounded(void *sock, const void *buf, size_t n, double bound_s, int *err)
{
    double until = now_s() + bound_s;
    while (epd_zmq_send_bytes(sock, buf, n, err) < 0) {
        if (*err != EAGAIN)
            return -1;
        if (now_s() > until) {
            *err = ETIMEDOUT;
            return -1;
        }
        struct timespec pause = {0, 100000};
        nanosleep(&pause, NULL);
    }
    return 0;
}

/* transfer.core.polls.PollSchedule, the same rule. */
struct schedule {
    double min_s, max_s, backoff, short_until;
    int waited_on;
};

static void schedule_started(struct schedule *s, uint64_t nbytes, double now)
{
    if (nbytes <= SHORT_WRITE_BYTES)
        s->short_until = now + SHORT_WRITE_S;
}

static void schedule_polled(struct schedule *s, int found_done, int waited_on)
{
    double doubled = 2 * s->backoff;
    s->backoff = found_done ? s->min_s : (doubled < s->max_s ? doubled : s->max_s);
    s->waited_on = waited_on > 1 ? waited_on : 1;
}

static double schedule_sleep(const struct schedule *s, double now)
{
    if (now < s->short_until) {
        double paced = s->min_s * s->waited_on;
        return paced < s->backoff ? paced : s->backoff;
    }
    return s->backoff;
}

struct receiver {
    int64_t rank;
    void *push;
    uint64_t segment; /* the Mooncake segment handle of its session */
    uint64_t row_start, rows;
};

struct flight {
    uint64_t batch, nbytes;
    int64_t room;
    int receiver;
};

struct serving {
    void *engine, *pull;
    int pull_fd, nrx;
    struct receiver rx[MAX_RECEIVERS];
    long long until;
    double deadline_s;
    struct schedule schedule;
    uint64_t base, row_bytes;
    int64_t starts, step, warmup;
};

/* Files the asks queued: each one's write submitted. NULL, or what went wrong (in detail). */
static const char *take_asks(struct serving *s, struct flight *flights, int *nflights, double *progressed,
                             char *detail)
{
    for (;;) {
        unsigned char ask[ASK_BYTES];
        int err;
        int n = epd_zmq_recv_into(s->pull, ask, sizeof ask, &err);
        if (n < 0 && err == EAGAIN)
            return NULL;
        if (n != ASK_BYTES) {
            snprintf(detail, DETAIL_BYTES, "floor encode: an ask that is not %d bytes (errno %d)", ASK_BYTES,
                     n < 0 ? err : 0);
            return detail;
        }
        int64_t room = (int64_t)epd_get_le64(ask), rank = (int64_t)epd_get_le64(ask + 8);
        uint64_t dst = epd_get_le64(ask + 16);
        int r = 0;
        while (r < s->nrx && s->rx[r].rank != rank)
            r++;
        if (r == s->nrx || *nflights == MAX_FLIGHTS) {
            snprintf(detail, DETAIL_BYTES, "floor encode: room %lld's ask from prefill rank %lld: %s", (long long)room,
                     (long long)rank, r == s->nrx ? "not a rank it serves" : "too many writes in flight");
            return detail;
        }
        /* ItemSource.offset(): Python's modulo, never negative. */
        int64_t start = ((room % s->starts) * (s->step % s->starts)) % s->starts;
        start = start < 0 ? start + s->starts : start;
        uint64_t nbytes = s->rx[r].rows * s->row_bytes;
        uint64_t src = s->base + ((uint64_t)start + s->rx[r].row_start) * s->row_bytes;
        uint64_t batch = epd_mc_write(s->engine, s->rx[r].segment, src, dst, nbytes);
        if (batch == 0) {
            snprintf(detail, DETAIL_BYTES, "floor encode: Mooncake refused room %lld's write to prefill rank %lld",
                     (long long)room, (long long)rank);
            return detail;
        }
        flights[(*nflights)++] = (struct flight){batch, nbytes, room, r};
        *progressed = now_s();
        schedule_started(&s->schedule, nbytes, *progressed);
    }
}

/* Serves asks until s->until statuses went out; the bytes of the rooms but the warm-up's. */
static const char *serve(struct serving *s, struct flight *flights, uint64_t *bytes, char *detail)
{
    int nflights = 0;
    long long served = 0;
    double progressed = now_s();
    while (served < s->until) {
        const char *failed = take_asks(s, flights, &nflights, &progressed, detail);
        if (failed != NULL)
            return failed;
        int kept = 0, found = 0, nwaited = 0;
        unsigned char waited[MAX_RECEIVERS] = {0};
        for (int i = 0; i < nflights; i++) {
            struct flight f = flights[i];
            long state = epd_mc_check(s->engine, f.batch);
            if (state == 0 || state == -2) {
                flights[kept++] = f;
                nwaited += !waited[f.receiver];
                waited[f.receiver] = 1;
                continue;
            }
            unsigned char status[STATUS_BYTES];
            int err = 0;
            epd_put_le64(status, (uint64_t)f.room);
            if (state != 1 || send_bounded(s->rx[f.receiver].push, status, sizeof status, s->deadline_s, &err) < 0) {
                snprintf(detail, DETAIL_BYTES, "floor encode: room %lld to prefill rank %lld: %s %ld (errno %d)",
                         (long long)f.room, (long long)s->rx[f.receiver].rank,
                         state != 1 ? "the write failed, Mooncake's state" : "its status was not sent, state", state,
                         err);
                return detail;
            }
            served++;
            found = 1;
            progressed = now_s();
            if (f.room != s->warmup)
                *bytes += f.nbytes;
        }
        nflights = kept;
        schedule_polled(&s->schedule, found, nwaited);
        if (served < s->until) {
            double now = now_s();
            if (now - progressed > s->deadline_s) {
                snprintf(detail, DETAIL_BYTES, "floor encode: %lld asks left, none came or completed for %gs",
                         s->until - served, s->deadline_s);
                return detail;
            }
            sleep_on(s->pull_fd, nflights ? schedule_sleep(&s->schedule, now) : 0.1);
        }
    }
    return NULL;
}

static int ready(void)
{
    if (!epd_zmq_ready() || !epd_mc_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "floor: zmq_bind() and mooncake_bind() must be called first");
        return 0;
    }
    return 1;
}

static void *handle_of(PyObject *obj)
{
    void *handle = PyLong_AsVoidPtr(obj);
    if (handle == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "floor: a socket handle is 0");
    return handle;
}

/* The longest deadline or poll interval, in seconds (about 31 years). */
#define MAX_SECONDS 1e9

/* Refuses a deadline or poll interval outside 0..MAX_SECONDS: the loops wait on it, and NaN or an
 * infinity is no bound, nor is it (or a longer time) a time a timespec can be converted to. */
static int seconds_arg(const char *who, const char *what, double seconds)
{
    if (seconds >= 0 && seconds <= MAX_SECONDS)
        return 0;
    char text[128];
    snprintf(text, sizeof text, "%s: %s must be a number of seconds in 0..%g, got %g", who, what, MAX_SECONDS,
             seconds);
    PyErr_SetString(PyExc_ValueError, text);
    return -1;
}

/* Refuses a receiver whose writes' arithmetic would wrap: every source range the loop computes,
 * base + (start + row_start) * row_bytes for start in 0..starts-1 and rows * row_bytes bytes long,
 * must end inside the 64-bit address space. */
static int rows_fit(const struct serving *s, const struct receiver *r, int i)
{
    uint64_t end_row, end_offset, end;
    if (__builtin_add_overflow((uint64_t)(s->starts - 1), r->row_start, &end_row) ||
        __builtin_add_overflow(end_row, r->rows, &end_row) ||
        __builtin_mul_overflow(end_row, s->row_bytes, &end_offset) ||
        __builtin_add_overflow(s->base, end_offset, &end)) {
        char text[240];
        snprintf(text, sizeof text, "floor_serve: receiver %d's writes (%llu rows of %llu bytes from row %llu, %lld "
                 "starts, base 0x%llx) run past the 64-bit address space", i, (unsigned long long)r->rows,
                 (unsigned long long)s->row_bytes, (unsigned long long)r->row_start, (long long)s->starts,
                 (unsigned long long)s->base);
        PyErr_SetString(PyExc_ValueError, text);
        return -1;
    }
    return 0;
}

/* Reads one receiver, a tuple (rank, push handle, segment, row_start, rows), into r; 0, or -1 with a
 * TypeError or ValueError that names the receiver. Every u64 field is range-checked (epd_u64_arg): a
 * negative rows or row_start read as its low 64 bits would pass as a huge count. */
static int receiver_arg(PyObject *item, int i, struct receiver *r)
{
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_Format(PyExc_TypeError, "floor_serve: receiver %d must be a tuple (rank, push handle, segment, "
                     "row_start, rows), not %.100s", i, Py_TYPE(item)->tp_name);
        return -1;
    }
    PyObject *rank_o = PyTuple_GET_ITEM(item, 0);
    long long rank = PyLong_AsLongLong(rank_o);
    if (rank == -1 && PyErr_Occurred()) {
        /* As epd_u64_arg answers: TypeError for no integer, ValueError for one out of range. */
        PyObject *type = PyErr_ExceptionMatches(PyExc_TypeError)       ? PyExc_TypeError
                         : PyErr_ExceptionMatches(PyExc_OverflowError) ? PyExc_ValueError
                                                                       : NULL;
        if (type != NULL) {
            PyErr_Clear();
            PyErr_Format(type, "floor_serve: receiver %d's rank must be an int64, got %R", i, rank_o);
        }
        return -1;
    }
    r->rank = rank;
    char segment[64], row_start[64], rows[64];
    snprintf(segment, sizeof segment, "floor_serve: receiver %d's segment", i);
    snprintf(row_start, sizeof row_start, "floor_serve: receiver %d's row_start", i);
    snprintf(rows, sizeof rows, "floor_serve: receiver %d's rows", i);
    if ((r->push = handle_of(PyTuple_GET_ITEM(item, 1))) == NULL ||
        epd_u64_arg(PyTuple_GET_ITEM(item, 2), segment, &r->segment) < 0 ||
        epd_u64_arg(PyTuple_GET_ITEM(item, 3), row_start, &r->row_start) < 0 ||
        epd_u64_arg(PyTuple_GET_ITEM(item, 4), rows, &r->rows) < 0)
        return -1;
    return 0;
}

/* floor_serve(engine, pull, pull_fd, receivers, until, deadline_s, poll_min_s, poll_max_s, base,
 *             row_bytes, starts, step, warmup) -> bytes written for rooms other than `warmup`. */
PyObject *epd_floor_serve(PyObject *self, PyObject *args)
{
    (void)self;
    struct serving s;
    memset(&s, 0, sizeof s);
    PyObject *engine_obj, *pull_obj, *receivers, *base_obj, *row_bytes_obj;
    if (!PyArg_ParseTuple(args, "OOiO!LdddOOLLL:floor_serve", &engine_obj, &pull_obj, &s.pull_fd, &PyList_Type,
                          &receivers, &s.until, &s.deadline_s, &s.schedule.min_s, &s.schedule.max_s, &base_obj,
                          &row_bytes_obj, &s.starts, &s.step, &s.warmup))
        return NULL;
    uint64_t engine;
    if (epd_u64_arg(engine_obj, "engine", &engine) < 0 || (s.pull = handle_of(pull_obj)) == NULL ||
        epd_u64_arg(base_obj, "floor_serve: base", &s.base) < 0 ||
        epd_u64_arg(row_bytes_obj, "floor_serve: row_bytes", &s.row_bytes) < 0 ||
        seconds_arg("floor_serve", "deadline_s", s.deadline_s) < 0 ||
        seconds_arg("floor_serve", "poll_min_s", s.schedule.min_s) < 0 ||
        seconds_arg("floor_serve", "poll_max_s", s.schedule.max_s) < 0)
        return NULL;
    s.engine = (void *)(uintptr_t)engine;
    /* A tuple of our own: parsing a receiver may run Python (__index__), which could change the list. The
       sockets behind the handles are the caller's to keep open while the loop runs. */
    PyObject *rx = PySequence_Tuple(receivers);
    if (rx == NULL)
        return NULL;
    s.nrx = (int)PyTuple_GET_SIZE(rx);
    if (s.nrx < 1 || s.nrx > MAX_RECEIVERS || s.starts < 1 || s.starts > MAX_STARTS || s.until < 0) {
        Py_DECREF(rx);
        PyErr_Format(PyExc_ValueError, "floor_serve: 1 to %d receivers, starts in 1..%lld and until >= 0",
                     MAX_RECEIVERS, (long long)MAX_STARTS);
        return NULL;
    }
    for (int i = 0; i < s.nrx; i++) {
        if (receiver_arg(PyTuple_GET_ITEM(rx, i), i, &s.rx[i]) < 0 || rows_fit(&s, &s.rx[i], i) < 0) {
            Py_DECREF(rx);
            return NULL;
        }
    }
    if (!ready()) {
        Py_DECREF(rx);
        return NULL;
    }
    s.schedule.backoff = s.schedule.min_s;
    s.schedule.short_until = -1e300;
    s.schedule.waited_on = 1;
    struct flight *flights = PyMem_RawMalloc(MAX_FLIGHTS * sizeof *flights);
    if (flights == NULL) {
        Py_DECREF(rx);
        return PyErr_NoMemory();
    }
    char detail[DETAIL_BYTES] = "";
    uint64_t bytes = 0;
    const char *failed;
    Py_BEGIN_ALLOW_THREADS
    failed = serve(&s, flights, &bytes, detail);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(flights);
    Py_DECREF(rx);
    if (failed != NULL)
        return PyErr_Format(PyExc_RuntimeError, "%s", failed);
    return PyLong_FromUnsignedLongLong(bytes);
}

struct asking {
    void *push, *pull;
    int pull_fd;
    int64_t rank, items, nslots;
    const uint64_t *slots;
    double deadline_s;
    uint64_t width, nbytes;
};

static const char *ask(const struct asking *a, int64_t room, int64_t slot, char *detail)
{
    unsigned char msg[ASK_BYTES];
    int err;
    epd_put_le64(msg, (uint64_t)room);
    epd_put_le64(msg + 8, (uint64_t)a->rank);
    epd_put_le64(msg + 16, a->slots[slot]);
    if (send_bounded(a->push, msg, sizeof msg, a->deadline_s, &err) == 0)
        return NULL;
    snprintf(detail, DETAIL_BYTES, "floor prefill %lld: room %lld's ask was not sent (errno %d)", (long long)a->rank,
             (long long)room, err);
    return detail;
}

/* The next status's room, waiting at most the deadline: negative (detail says why) when none came
 * or it named a negative room. */
static int64_t next_status(const struct asking *a, char *detail)
{
    double until = now_s() + a->deadline_s;
    for (;;) {
        unsigned char msg[STATUS_BYTES];
        int err;
        int n = epd_zmq_recv_into(a->pull, msg, sizeof msg, &err);
        if (n == STATUS_BYTES) {
            int64_t room = (int64_t)epd_get_le64(msg);
            if (room < 0)
                snprintf(detail, DETAIL_BYTES, "floor prefill %lld: a status for room %lld, not asked for",
                         (long long)a->rank, (long long)room);
            return room;
        }
        double left = until - now_s();
        if ((n < 0 && err != EAGAIN) || n >= 0 || left <= 0) {
            snprintf(detail, DETAIL_BYTES, "floor prefill %lld: %s", (long long)a->rank,
                     left <= 0 ? "no status within the deadline" : "a status that is not 8 bytes");
            return -1;
        }
        sleep_on(a->pull_fd, left);
    }
}

/* Asks for rooms 0..items-1, `nslots` at a time, each into the slot the room before it freed. */
static const char *receive(const struct asking *a, int64_t *rooms, int64_t *slots_of, double *latencies,
                           unsigned char *prints, double *started, int64_t *slot_of, char *detail)
{
    int64_t asked = 0, first = a->nslots < a->items ? a->nslots : a->items;
    for (int64_t i = 0; i < a->items; i++)
        slot_of[i] = -1;
    const char *failed;
    while (asked < first) {
        started[asked] = now_s();
        slot_of[asked] = asked;
        if ((failed = ask(a, asked, asked, detail)) != NULL)
            return failed;
        asked++;
    }
    for (int64_t i = 0; i < a->items; i++) {
        int64_t room = next_status(a, detail);
        if (room < 0)
            return detail;
        if (room >= a->items || slot_of[room] < 0) {
            snprintf(detail, DETAIL_BYTES, "floor prefill %lld: a status for room %lld, not asked for",
                     (long long)a->rank, (long long)room);
            return detail;
        }
        int64_t slot = slot_of[room];
        slot_of[room] = -1;
        latencies[i] = now_s() - started[room];
        rooms[i] = room;
        slots_of[i] = slot;
        const unsigned char *landed = (const unsigned char *)(uintptr_t)a->slots[slot];
        memcpy(prints + 2 * a->width * (size_t)i, landed, a->width);
        memcpy(prints + 2 * a->width * (size_t)i + a->width, landed + a->nbytes - a->width, a->width);
        if (asked < a->items) {
            started[asked] = now_s();
            slot_of[asked] = slot;
            if ((failed = ask(a, asked, slot, detail)) != NULL)
                return failed;
            asked++;
        }
    }
    return NULL;
}

/* floor_receive(push, pull, pull_fd, rank, slots, items, deadline_s, width, nbytes) -> (rooms,
 * slots, latencies, prints): in the order the rooms concluded, each room (i64), the slot it
 * landed in (i64), its latency in seconds (double), and the first and last `width` bytes of its
 * shard as they were at its status (native byte order; prints: 2 * width bytes a room). */
PyObject *epd_floor_receive(PyObject *self, PyObject *args)
{
    (void)self;
    struct asking a;
    memset(&a, 0, sizeof a);
    PyObject *push_obj, *pull_obj, *slot_list, *width_obj, *nbytes_obj;
    long long rank, items;
    if (!PyArg_ParseTuple(args, "OOiLO!LdOO:floor_receive", &push_obj, &pull_obj, &a.pull_fd, &rank, &PyList_Type,
                          &slot_list, &items, &a.deadline_s, &width_obj, &nbytes_obj))
        return NULL;
    if ((a.push = handle_of(push_obj)) == NULL || (a.pull = handle_of(pull_obj)) == NULL ||
        epd_u64_arg(width_obj, "floor_receive: width", &a.width) < 0 ||
        epd_u64_arg(nbytes_obj, "floor_receive: nbytes", &a.nbytes) < 0 ||
        seconds_arg("floor_receive", "deadline_s", a.deadline_s) < 0)
        return NULL;
    a.rank = rank;
    a.items = items;
    a.nslots = PyList_GET_SIZE(slot_list);
    if (items < 0 || a.nslots < 1 || a.width < 1 || a.width > a.nbytes || (uint64_t)items > ((uint64_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "floor_receive: items >= 0, a slot at least, 1 <= width <= nbytes");
        return NULL;
    }
    /* The prints come back in one bytes object of 2 * width bytes a room. */
    if (items > 0 && a.width > (uint64_t)(PY_SSIZE_T_MAX / 2) / (uint64_t)items) {
        char text[160];
        snprintf(text, sizeof text, "floor_receive: %lld rooms' prints of 2 x %llu bytes each exceed the largest "
                 "bytes object (%zd bytes)", items, (unsigned long long)a.width, PY_SSIZE_T_MAX);
        PyErr_SetString(PyExc_ValueError, text);
        return NULL;
    }
    /* A tuple of our own: reading a slot's address may run Python (__index__), which could change the list. */
    PyObject *slot_tuple = PySequence_Tuple(slot_list);
    if (slot_tuple == NULL)
        return NULL;
    a.nslots = PyTuple_GET_SIZE(slot_tuple);
    uint64_t *slots = PyMem_RawMalloc((size_t)a.nslots * sizeof *slots);
    double *started = PyMem_RawMalloc(((size_t)items + 1) * sizeof *started);
    int64_t *slot_of = PyMem_RawMalloc(((size_t)items + 1) * sizeof *slot_of);
    PyObject *rooms = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(items * 8));
    PyObject *slots_of = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(items * 8));
    PyObject *latencies = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(items * 8));
    PyObject *prints = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((uint64_t)items * 2 * a.width));
    PyObject *result = NULL;
    if (slots == NULL || started == NULL || slot_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (rooms == NULL || slots_of == NULL || latencies == NULL || prints == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < a.nslots; i++) {
        if (epd_u64_arg(PyTuple_GET_ITEM(slot_tuple, i), "slot", &slots[i]) < 0)
            goto done;
        /* The loop reads a room's prints from slot .. slot + nbytes. */
        if (slots[i] == 0 || slots[i] + a.nbytes < slots[i]) {
            char text[128];
            snprintf(text, sizeof text, "floor_receive: slot %zd (0x%llx+%llu) is not a range of the address space",
                     i, (unsigned long long)slots[i], (unsigned long long)a.nbytes);
            PyErr_SetString(PyExc_ValueError, text);
            goto done;
        }
    }
    if (!epd_zmq_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "floor: zmq_bind() must be called first");
        goto done;
    }
    a.slots = slots;
    char detail[DETAIL_BYTES] = "";
    const char *failed;
    Py_BEGIN_ALLOW_THREADS
    failed = receive(&a, (int64_t *)PyBytes_AS_STRING(rooms), (int64_t *)PyBytes_AS_STRING(slots_of),
                     (double *)PyBytes_AS_STRING(latencies), (unsigned char *)PyBytes_AS_STRING(prints), started,
                     slot_of, detail);
    Py_END_ALLOW_THREADS
    if (failed != NULL)
        PyErr_Format(strstr(failed, "deadline") ? PyExc_TimeoutError : PyExc_RuntimeError, "%s", failed);
    else
        result = PyTuple_Pack(4, rooms, slots_of, latencies, prints);
done:
    Py_DECREF(slot_tuple);
    PyMem_RawFree(slots);
    PyMem_RawFree(started);
    PyMem_RawFree(slot_of);
    Py_XDECREF(rooms);
    Py_XDECREF(slots_of);
    Py_XDECREF(latencies);
    Py_XDECREF(prints);
    return result;
}
