/* Mooncake's write and status calls made from C, on the engine the Python binding started.
 *
 * The same calls the binding makes, without its Python layer (docs/performance-log.md, "Kept:
 * Mooncake's calls from C"). We do not link Mooncake: its binding's
 * get_engine_ptr() gives the mooncake::TransferEngine it holds, and mooncake_bind() looks up
 * five of that class's methods by their mangled names in the engine.so the binding already
 * loaded. The declarations below are ours, read from that library's code for one wheel
 * version (transfer/engine.py calls mooncake_bind() for that version only): a method
 * returning Status by value takes a hidden result pointer first and `this` second, and a
 * `const std::vector<T>&` is a pointer to libstdc++'s {begin, end, end of storage}.
 *
 * The write lets go of the GIL (the copying threads it wakes may take the cores first); the
 * other calls keep it, since none waits on the network (openSegment would, which is why the
 * caller opens a segment only once the binding's own write opened it, so the call answers
 * from Mooncake's cache).
 */
#include "epd.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <time.h>

/* mooncake::Transport::TransferRequest, 56 bytes. */
struct mc_request {
    int32_t opcode; /* READ 0, WRITE 1 */
    void *source;
    uint64_t target_id; /* the segment handle */
    uint64_t target_offset; /* the peer's address */
    uint64_t length;
    int32_t advise_retry_cnt;
    int32_t transport_hint;
    uint64_t task_group_id;
};
_Static_assert(sizeof(struct mc_request) == 56, "TransferRequest is 56 bytes");
_Static_assert(offsetof(struct mc_request, length) == 32 && offsetof(struct mc_request, task_group_id) == 48,
               "TransferRequest's layout");

/* A `const std::vector<TransferRequest>&` as libstdc++ lays the vector out. */
struct mc_request_vector {
    const struct mc_request *begin, *end, *end_of_storage;
};

/* mooncake::Status, 16 bytes: a code (0 is ok) and a message allocated with new[] (null when ok). */
struct mc_status {
    uint16_t code;
    char *message;
};
_Static_assert(sizeof(struct mc_status) == 16, "Status is 16 bytes");

/* mooncake::Transport::TransferStatus: the state, then the bytes moved. */
struct mc_transfer_status {
    int32_t state;
    uint64_t transferred_bytes;
};
_Static_assert(sizeof(struct mc_transfer_status) == 16, "TransferStatus is 16 bytes");

/* A std::__cxx11::string as libstdc++ lays it out; openSegment only reads it. */
struct mc_string {
    const char *data;
    size_t size;
    union {
        char local[16];
        size_t capacity;
    } u;
};

#define MC_WRITE 1
#define MC_COMPLETED 4
#define MC_TIMEOUT 5
#define MC_FAILED 6

static uint64_t (*allocate_batch)(void *engine, size_t batch_size);
static void (*submit_transfer)(struct mc_status *ret, void *engine, uint64_t batch, const struct mc_request_vector *);
static void (*transfer_status)(struct mc_status *ret, void *engine, uint64_t batch, size_t task,
                               struct mc_transfer_status *out);
static void (*free_batch)(struct mc_status *ret, void *engine, uint64_t batch);
static uint64_t (*open_segment)(void *engine, const struct mc_string *name);
static void (*delete_array)(void *);

static const struct {
    const char *name;
    void **slot;
    int bound_as_mooncake; /* looked up where the library's own references bind, not in the library */
} symbols[] = {
    {"_ZN8mooncake14TransferEngine15allocateBatchIDEm", (void **)&allocate_batch, 0},
    {"_ZN8mooncake14TransferEngine14submitTransferEmRKSt6vectorINS_9Transport15TransferRequestESaIS3_EE",
     (void **)&submit_transfer, 0},
    {"_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14TransferStatusE", (void **)&transfer_status,
     0},
    {"_ZN8mooncake14TransferEngine11freeBatchIDEm", (void **)&free_batch, 0},
    {"_ZN8mooncake14TransferEngine11openSegmentERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
     (void **)&open_segment, 0},
    /* operator delete[], for a Status' message: the one Mooncake's own delete[] calls, partner of the
       new[] that allocated it. A library Python loaded (RTLD_LOCAL) binds its references in the global
       scope first, where a preloaded allocator or sanitizer may replace the C++ operators, and only then
       among its own dependencies, where libstdc++'s delete[] forwards to the global scalar delete: a
       mismatch for such a replacement (AddressSanitizer aborts on it). */
    {"_ZdaPv", (void **)&delete_array, 1},
};
#define NSYMBOLS (sizeof(symbols) / sizeof(symbols[0]))

/* What Status' destructor does: returns the code. */
static int status_code(struct mc_status *s)
{
    if (s->message != NULL)
        delete_array(s->message);
    s->message = NULL;
    return s->code;
}

static int is_bound(void)
{
    if (submit_transfer == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mooncake_bind() was not called");
        return 0;
    }
    return 1;
}

/* mooncake_bind(path): finds the methods in the already loaded library at path (never loads it). */
PyObject *epd_mooncake_bind(PyObject *self, PyObject *args)
{
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s:mooncake_bind", &path))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return PyErr_Format(PyExc_OSError, "mooncake_bind: %s is not loaded", path);
    void *found[NSYMBOLS];
    for (size_t i = 0; i < NSYMBOLS; i++) {
        found[i] = symbols[i].bound_as_mooncake ? dlsym(RTLD_DEFAULT, symbols[i].name) : NULL;
        if (found[i] == NULL)
            found[i] = dlsym(lib, symbols[i].name);
        if (found[i] == NULL) {
            dlclose(lib);
            return PyErr_Format(PyExc_OSError, "mooncake_bind: %s has no %s", path, symbols[i].name);
        }
    }
    for (size_t i = 0; i < NSYMBOLS; i++)
        *symbols[i].slot = found[i];
    /* The reference dlopen took stays: the binding keeps the library loaded anyway. */
    Py_RETURN_NONE;
}

/* mooncake_open(engine, segment) -> handle, or -1 when Mooncake could not open it. */
PyObject *epd_mooncake_open(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *engine_obj;
    const char *name;
    Py_ssize_t size;
    uint64_t engine;
    if (!PyArg_ParseTuple(args, "Os#:mooncake_open", &engine_obj, &name, &size))
        return NULL;
    if (!is_bound() || epd_u64_arg(engine_obj, "engine", &engine) < 0)
        return NULL;
    struct mc_string text = {name, (size_t)size, {{0}}};
    text.u.capacity = (size_t)size;
    uint64_t handle = open_segment((void *)(uintptr_t)engine, &text);
    return PyLong_FromLongLong(handle == UINT64_MAX ? -1 : (long long)handle);
}

int epd_mc_ready(void)
{
    return submit_transfer != NULL;
}

/* The CPU time the calling threads spent inside epd_mc_write and epd_mc_check while counting is on
 * (mooncake_account): Mooncake's own work on our threads. Reading a thread's CPU clock is a system call,
 * so counting is off unless a bench asks for it. */
static atomic_int counting;
static atomic_ullong counted_ns;

static unsigned long long thread_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static uint64_t write_one(void *te, uint64_t handle, uint64_t src, uint64_t dst, uint64_t length)
{
    struct mc_request request = {MC_WRITE, (void *)(uintptr_t)src, handle, dst, length, 0, 0, 0};
    struct mc_request_vector requests = {&request, &request + 1, &request + 1};
    uint64_t batch = allocate_batch(te, 1);
    struct mc_status status = {0, NULL};
    submit_transfer(&status, te, batch, &requests);
    if (status_code(&status) != 0) {
        struct mc_status freed = {0, NULL};
        free_batch(&freed, te, batch);
        status_code(&freed);
        batch = 0;
    }
    return batch;
}

uint64_t epd_mc_write(void *te, uint64_t handle, uint64_t src, uint64_t dst, uint64_t length)
{
    if (!atomic_load_explicit(&counting, memory_order_relaxed))
        return write_one(te, handle, src, dst, length);
    unsigned long long started = thread_ns();
    uint64_t batch = write_one(te, handle, src, dst, length);
    atomic_fetch_add_explicit(&counted_ns, thread_ns() - started, memory_order_relaxed);
    return batch;
}

static long check(void *te, uint64_t batch)
{
    struct mc_transfer_status state = {-1, 0};
    struct mc_status status = {0, NULL};
    transfer_status(&status, te, batch, 0, &state);
    int code = status_code(&status);
    if (code != 0)
        return -1000 - code;
    if (state.state == MC_COMPLETED || state.state == MC_FAILED) {
        struct mc_status freed = {0, NULL};
        free_batch(&freed, te, batch);
        status_code(&freed);
        return state.state == MC_COMPLETED ? 1 : -1;
    }
    return state.state == MC_TIMEOUT ? -2 : 0;
}

long epd_mc_check(void *te, uint64_t batch)
{
    if (!atomic_load_explicit(&counting, memory_order_relaxed))
        return check(te, batch);
    unsigned long long started = thread_ns();
    long rc = check(te, batch);
    atomic_fetch_add_explicit(&counted_ns, thread_ns() - started, memory_order_relaxed);
    return rc;
}

/* mooncake_account(on): counts the calls' CPU from now on (True) or no longer (False). */
PyObject *epd_mooncake_account(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    atomic_store(&counting, on);
    Py_RETURN_NONE;
}

/* mooncake_cpu() -> the seconds of thread CPU counted so far inside Mooncake's write and status calls. */
PyObject *epd_mooncake_cpu(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyFloat_FromDouble((double)atomic_load(&counted_ns) / 1e9);
}

/* mooncake_write(engine, handle, src, dst, length) -> batch id: one WRITE as a batch of its own;
 * 0 when Mooncake refused it (the batch is freed). */
PyObject *epd_mooncake_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t engine, handle, src, dst, length;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "mooncake_write takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!is_bound() || epd_u64_arg(args[0], "engine", &engine) < 0 || epd_u64_arg(args[1], "handle", &handle) < 0 ||
        epd_u64_arg(args[2], "src", &src) < 0 || epd_u64_arg(args[3], "dst", &dst) < 0 ||
        epd_u64_arg(args[4], "length", &length) < 0)
        return NULL;
    /* The call wakes Mooncake's copying threads, which may take the cores before it returns: other
     * Python threads, the model's among them, run meanwhile. */
    uint64_t batch;
    Py_BEGIN_ALLOW_THREADS
    batch = epd_mc_write((void *)(uintptr_t)engine, handle, src, dst, length);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(batch);
}

/* mooncake_check(engine, batch) -> what the binding's transfer_check_status answers for a
 * batch's first task: 1 completed, -1 failed (both free the batch), -2 timed out (a warning:
 * it still ends later), 0 in flight; or -1000 - code when Mooncake could not read it. */
PyObject *epd_mooncake_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t engine, batch;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "mooncake_check takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!is_bound() || epd_u64_arg(args[0], "engine", &engine) < 0 || epd_u64_arg(args[1], "batch", &batch) < 0)
        return NULL;
    return PyLong_FromLong(epd_mc_check((void *)(uintptr_t)engine, batch));
}

/* mooncake_settle(engine, batches) -> what is left of one write's batches in flight, `batches` (a list of
 * batch ids, oldest first) checked from its first and each batch that is over taken off it, as Mooncake
 * freed it when it answered so: 1 when none is left, 0 when the first left is in flight (or timed out: it
 * still ends later), or the code of a batch that failed (-1, or -1000 - code when Mooncake could not read
 * its status), that batch taken off and those after it not checked yet. The GIL is held all along: no
 * other thread sees the list between a batch's check and its removal. A batch whose reading changed the
 * list (its __index__) is RuntimeError, and Mooncake is not asked about it. */
PyObject *epd_mooncake_settle(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    uint64_t engine, batch;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "mooncake_settle takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *batches = args[1];
    if (!PyList_CheckExact(batches)) {
        PyErr_Format(PyExc_TypeError, "mooncake_settle: the batches must be a list, not %.80s",
                     Py_TYPE(batches)->tp_name);
        return NULL;
    }
    if (!is_bound() || epd_u64_arg(args[0], "engine", &engine) < 0)
        return NULL;
    while (PyList_GET_SIZE(batches) > 0) {
        /* Held while it is read: a batch that is no int runs its __index__, which may change the list and
           drop the list's reference to it, and the slice below must take off the very batch checked. */
        PyObject *first = Py_NewRef(PyList_GET_ITEM(batches, 0));
        if (epd_u64_arg(first, "batch", &batch) < 0) {
            Py_DECREF(first);
            return NULL;
        }
        if (PyList_GET_SIZE(batches) == 0 || PyList_GET_ITEM(batches, 0) != first) {
            Py_DECREF(first);
            PyErr_SetString(PyExc_RuntimeError, "mooncake_settle: the batches list changed while a batch was read");
            return NULL;
        }
        long rc = epd_mc_check((void *)(uintptr_t)engine, batch);
        if (rc == 0 || rc == -2) {
            Py_DECREF(first);
            return PyLong_FromLong(0);
        }
        int cut = PyList_SetSlice(batches, 0, 1, NULL);
        Py_DECREF(first);
        if (cut < 0)
            return NULL;
        if (rc < 0)
            return PyLong_FromLong(rc);
    }
    return PyLong_FromLong(1);
}
