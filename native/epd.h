/* Shared declarations of the native core: the framed wire, the Msg codec and the layer checksum. */
#ifndef EPD_H
#define EPD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

/* SPEC.md section 9: a payload (what follows the kind byte) is at most 64 MiB. */
#define EPD_MAX_PAYLOAD ((size_t)64 << 20)
/* The largest answer (RESULT or ERROR) a sender reads after a transfer. */
#define EPD_MAX_ANSWER ((size_t)64 << 10)
/* Bytes of a LAYER payload's header: u32 layer, u32 rows, u64 checksum. */
#define EPD_LAYER_HEADER 16

/* Exception types, created by the module (module.c) and raised by every part. */
extern PyObject *epd_FrameError;
extern PyObject *epd_MsgError;
extern PyObject *epd_LayerError;

/* module.c: reads an int argument that must fit in u64 (no silent wrap); `what` names it in the error. */
int epd_u64_arg(PyObject *obj, const char *what, uint64_t *out);

/* layer.c: pure C, no Python. */
uint64_t epd_layer_sum(const void *data, size_t len);
void epd_put_le32(unsigned char *out, uint32_t v);
void epd_put_le64(unsigned char *out, uint64_t v);
uint32_t epd_get_le32(const unsigned char *in);
uint64_t epd_get_le64(const unsigned char *in);
/* A frame's 5-byte header: u32 LE length (kind byte + payload), then the kind. */
#define EPD_FRAME_HEADER 5
void epd_put_frame_header(unsigned char *out, size_t payload_len, unsigned kind);
/* A LAYER payload's EPD_LAYER_HEADER bytes: u32 LE layer, u32 LE rows, u64 LE checksum. */
void epd_put_layer_header(unsigned char *out, uint32_t layer, uint32_t rows, uint64_t checksum);

/* Frame kinds the sender of a transfer writes (SPEC.md section 9). */
#define EPD_KIND_PREFILL 3
#define EPD_KIND_LAYER 10
#define EPD_KIND_FIRST 11

/* A run of memory: where it starts and how many bytes. */
struct epd_span {
    uint64_t addr;
    size_t len;
};

/* frame.c: whole-frame socket/fd I/O; the GIL must be held on entry. */
int epd_write_frame(int fd, unsigned kind, Py_buffer *parts, Py_ssize_t nparts, double timeout);
/* Reads one frame whose payload is at most `limit` bytes (refused before anything is allocated);
   with min_rate > 0 (bytes/s) the whole read must end within timeout plus `limit` bytes at that
   rate (FrameError, ETIMEDOUT). */
PyObject *epd_read_frame(int fd, double timeout, size_t limit, double min_rate);
/* One whole transfer on a connection: the PREFILL payload, each layer in LAYER chunks of at most
   `chunk` bytes (checksummed), FIRST, then the answer frame, in one GIL release. Returns
   (complete, (kind, payload, wire_us)); complete is False when the peer spoke mid-transfer and
   the rest was not sent. A failure raises FrameError with `stage` "prefill" (the PREFILL did not
   get out whole: nothing of the transfer reached the peer), "data" or "answer". Every layer is
   non-empty and 1 <= nlayers <= 16 (the caller checks). With min_rate > 0 (bytes/s) the PREFILL and
   chunks must be taken within timeout plus their bytes at min_rate, and the answer (at most
   EPD_MAX_ANSWER bytes) must come within timeout plus that many bytes at min_rate, else
   FrameError (ETIMEDOUT). */
PyObject *epd_wire_transfer(int fd, Py_buffer *prefill, const struct epd_span *layers, int nlayers, uint32_t rows,
                            size_t chunk, double timeout, double min_rate);

/* msg.c: the key=value message codec. */
int epd_msg_check(PyObject *key, PyObject *value);
PyObject *epd_msg_encode(PyObject *fields, Py_buffer *body);
PyObject *epd_msg_decode(Py_buffer *data);

/* zmqmsg.c: whole multipart messages on pyzmq's sockets, through libzmq functions handed over by zmq_bind. */
PyObject *epd_zmq_bind(PyObject *self, PyObject *args);
PyObject *epd_zmq_recv_parts(PyObject *self, PyObject *args);
/* zmq_recv_parts for C callers (GIL held, zmq_bind called): a new reference to what it returns. */
PyObject *epd_zmq_recv_message(void *handle, Py_ssize_t max_bytes, Py_ssize_t max_parts);
PyObject *epd_zmq_send_parts(PyObject *self, PyObject *args);
/* zmq_send_parts for C callers (GIL held): the n parts data[i] of len[i] bytes (n >= 1) as one message: 0,
   or -1 with an exception set (an OSError with libzmq's errno when a send failed: nothing was delivered). */
int epd_zmq_send_spans(void *handle, const char *const *data, const size_t *len, Py_ssize_t n);
/* The same functions for C callers, which may run without the GIL: whether zmq_bind was called;
   one single-part message of at most cap bytes into buf, without blocking: its size, or -1 with
   libzmq's errno in *err (EAGAIN: none queued; EMSGSIZE: a longer or multipart message, dropped
   whole); one message of n bytes sent without blocking: 0, or -1 with libzmq's errno in *err. */
int epd_zmq_ready(void);
int epd_zmq_recv_into(void *handle, void *buf, size_t cap, int *err);
int epd_zmq_send_bytes(void *handle, const void *buf, size_t n, int *err);
/* A message handed to a taker (GIL held): 1, it took the message, appending what it made of it to
   `taken`; 0, it leaves the message to the general path; -1 with an exception set: the message goes
   the general path too, so the taker leaves nothing that path would not take as it comes. */
typedef int (*epd_taker)(void *ctx, PyObject *message, PyObject *taken);
/* Reads at most `most` messages off the socket (a pyzmq socket's handle, as an int) without blocking,
   bounded as zmq_recv_parts bounds them, handing each to `take` in arrival order up to the first it
   leaves. Returns (taken, message, empty): `message` is what zmq_recv_parts returned for the message
   left (its parts, or (bytes, parts) for one over the bounds), else None; `empty`, whether the socket
   had nothing more queued. A receive that fails after messages were taken ends the call with them: a
   socket's error fails again on the next call, and a message whose parts could not be allocated is
   lost, as ZMQ already handed it over; with none taken, it raises, as zmq_recv_parts does. */
PyObject *epd_zmq_take(PyObject *handle_obj, Py_ssize_t most, Py_ssize_t max_bytes, Py_ssize_t max_parts,
                       epd_taker take, void *ctx);

/* lane.c: the statuses a prefill driver settles in lanes (transfer/core/lane.py). */
PyObject *epd_lane_match(PyObject *self, PyObject *args);
PyObject *epd_lane_take(PyObject *self, PyObject *args);

/* ask.c: the asks an encode driver reads, parsed (transfer/frames.py's TransferInfo._from_plain_frames). */
PyObject *epd_ask_parse(PyObject *self, PyObject *args);
PyObject *epd_ask_take(PyObject *self, PyObject *args);
/* ask.c: the asks a prefill rank sends, encoded (transfer/frames.py's TransferInfo.to_frames, plain case). */
PyObject *epd_ask_frames(PyObject *self, PyObject *args);
PyObject *epd_ask_send(PyObject *self, PyObject *args);

/* mooncake.c: Mooncake's write and status calls on the binding's engine, once mooncake_bind found them. */
PyObject *epd_mooncake_bind(PyObject *self, PyObject *args);
PyObject *epd_mooncake_open(PyObject *self, PyObject *args);
PyObject *epd_mooncake_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *epd_mooncake_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *epd_mooncake_settle(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *epd_mooncake_account(PyObject *self, PyObject *arg);
PyObject *epd_mooncake_cpu(PyObject *self, PyObject *unused);
/* The same calls for C callers (no Python, so callable without the GIL; the caller keeps the engine
   alive): whether mooncake_bind found the methods; one WRITE as a batch of its own (0: refused);
   a batch's first task's state as mooncake_check answers it. */
int epd_mc_ready(void);
uint64_t epd_mc_write(void *te, uint64_t handle, uint64_t src, uint64_t dst, uint64_t length);
long epd_mc_check(void *te, uint64_t batch);

/* floor.c: the bench's floor path with its loops in C (the cfloor path of transfer/bench.py). */
PyObject *epd_floor_serve(PyObject *self, PyObject *args);
PyObject *epd_floor_receive(PyObject *self, PyObject *args);

#endif
