/* The statuses a prefill driver settles in lanes, read off its status socket in one call.
 *
 * The rule is transfer/core/lane.py's `settles`, which the unit suite holds this file to: a
 * plain Success (3 parts of 1 to 19 ASCII digits, then up to 2 checksum parts of 1 to 20 digits)
 * of a room in the lanes dict, from the encode rank the dict names for it. lane_take reads
 * messages in arrival order, takes each such room out of the dict and stops at the first message
 * that is anything else, which it hands back whole for the general path: no lane's Success is
 * taken ahead of an earlier message about its room.
 */
#include "epd.h"

#define LANE_PARTS 3
#define LANE_MAX_CHECKSUMS 2
#define LANE_MAX_DIGITS 19

/* Whether a part is bytes of 1 to `most` ASCII digits (most <= 20) holding a u64, which goes in *value. */
static int plain_number(PyObject *part, Py_ssize_t most, unsigned long long *value)
{
    if (!PyBytes_CheckExact(part))
        return 0;
    Py_ssize_t n = PyBytes_GET_SIZE(part);
    if (n == 0 || n > most)
        return 0;
    const unsigned char *digits = (const unsigned char *)PyBytes_AS_STRING(part);
    unsigned long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (digits[i] < '0' || digits[i] > '9')
            return 0;
        unsigned d = digits[i] - '0';
        if (v > (~0ULL - d) / 10)
            return 0; /* 20 digits past 2^64 - 1: not a u64 */
        v = v * 10 + d;
    }
    *value = v;
    return 1;
}

/* Whether `parts` settles a lane: 1 with the room in *room, 0 if not, -1 with an exception set. */
static int match(PyObject *parts, PyObject *lanes, unsigned long long success, long long *room)
{
    if (!PyList_CheckExact(parts))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(parts);
    if (n < LANE_PARTS || n > LANE_PARTS + LANE_MAX_CHECKSUMS)
        return 0;
    unsigned long long number[LANE_PARTS], sum;
    for (int i = 0; i < LANE_PARTS; i++) {
        if (!plain_number(PyList_GET_ITEM(parts, i), LANE_MAX_DIGITS, &number[i]))
            return 0;
    }
    if (number[0] > INT64_MAX || number[1] != success || number[2] > INT64_MAX)
        return 0;
    for (Py_ssize_t i = LANE_PARTS; i < n; i++) {
        if (!plain_number(PyList_GET_ITEM(parts, i), LANE_MAX_DIGITS + 1, &sum))
            return 0;
    }
    PyObject *key = PyLong_FromLongLong((long long)number[0]);
    if (key == NULL)
        return -1;
    PyObject *lane = PyDict_GetItemWithError(lanes, key); /* borrowed */
    Py_DECREF(key);
    if (lane == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_CheckExact(lane))
        return 0;
    int overflow;
    long long rank = PyLong_AsLongLongAndOverflow(lane, &overflow);
    if (rank == -1 && PyErr_Occurred())
        return -1;
    if (overflow || rank < 0 || (unsigned long long)rank != number[2])
        return 0;
    *room = (long long)number[0];
    return 1;
}

/* lane_match(parts, lanes, success) -> the room `parts` settles, or None (see `match`). */
PyObject *epd_lane_match(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts, *lanes;
    unsigned long long success;
    if (!PyArg_ParseTuple(args, "OO!K", &parts, &PyDict_Type, &lanes, &success))
        return NULL;
    long long room;
    int found = match(parts, lanes, success, &room);
    if (found < 0)
        return NULL;
    if (!found)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(room);
}

struct lanes {
    PyObject *lanes;
    unsigned long long success;
};

/* An epd_taker: a status that settles a lane takes its room out of the lanes dict, then onto `settled`. */
static int settle(void *ctx, PyObject *message, PyObject *settled)
{
    struct lanes *lanes = ctx;
    long long room;
    int found = match(message, lanes->lanes, lanes->success, &room);
    if (found <= 0)
        return found;
    PyObject *key = PyLong_FromLongLong(room);
    if (key == NULL)
        return -1;
    /* The lane goes first: a room whose append then fails is one without a lane, which the general
       path books from the message as it books any other. */
    int failed = PyDict_DelItem(lanes->lanes, key) < 0 || PyList_Append(settled, key) < 0;
    Py_DECREF(key);
    return failed ? -1 : 1;
}

/* lane_take(handle, lanes, success, most, max_bytes=0, max_parts=0) -> (settled, message, empty).
 *
 * Reads at most `most` messages off the socket without blocking, taking the rooms they settle out
 * of `lanes` in order (`settled`), up to the first message that settles none (`message`): see
 * epd_zmq_take. */
PyObject *epd_lane_take(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *handle_obj;
    struct lanes lanes;
    Py_ssize_t most, max_bytes = 0, max_parts = 0;
    if (!PyArg_ParseTuple(args, "OO!Kn|nn", &handle_obj, &PyDict_Type, &lanes.lanes, &lanes.success, &most,
                          &max_bytes, &max_parts))
        return NULL;
    return epd_zmq_take(handle_obj, most, max_bytes, max_parts, settle, &lanes);
}
