/* The control plane's floor in C: a room's asks and statuses over ZMQ and nothing else.
 *
 * usage: zmq_floor FANOUT INFLIGHT ROOMS WRITE_US PORT
 *
 * One encode process and FANOUT prefill processes on 127.0.0.1, PORT and the FANOUT
 * ports above it. Each prefill rank keeps INFLIGHT asks out (24 bytes: room, rank,
 * destination, pushed to the encode rank's PULL socket), as the bench's floor path does.
 * Once every rank asked for a room the encode rank lets WRITE_US pass (a write it would
 * poll; it sleeps meanwhile, woken early by asks) and pushes an 8-byte status to each
 * rank. There is no Python, no Mooncake and no rule: what is left is ZMQ's cost and the
 * wake-ups a room needs. Prints one line:
 *
 *   fanout inflight write_us rooms_per_s p50_ms control_ms_per_room encode_ms prefill_ms
 *
 * control = the CPU of every thread of every process (getrusage), ZMQ's I/O threads
 * included, over the timed rooms (after WARM rooms), per room; p50 is from an ask's
 * send to its status's receipt on the prefill rank.
 *
 * libzmq comes from the library pyzmq loaded (scripts/zmq-floor.sh links it), so no
 * header is needed: the few declarations below are libzmq 4's API.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} zmq_pollitem_t;
void *zmq_ctx_new(void);
void *zmq_socket(void *, int);
int zmq_bind(void *, const char *);
int zmq_connect(void *, const char *);
int zmq_send(void *, const void *, size_t, int);
int zmq_recv(void *, void *, size_t, int);
int zmq_poll(zmq_pollitem_t *, int, long);
int zmq_setsockopt(void *, int, const void *, size_t);
int zmq_close(void *);
int zmq_ctx_term(void *);
const char *zmq_strerror(int);
int zmq_errno(void);

enum { ZMQ_PULL_ = 7, ZMQ_PUSH_ = 8, ZMQ_POLLIN_ = 1, ZMQ_DONTWAIT_ = 1, ZMQ_LINGER_ = 17, ZMQ_RCVTIMEO_ = 27 };

/* STALL_MS: how long a process waits for its peer's next message before it gives up. */
enum { WARM = 300, MAX_FANOUT = 64, STALL_MS = 10000 };

typedef struct {
    double cpu_s;  /* all threads, over the timed rooms */
    double p50_s;  /* prefill ranks only */
    double rate;   /* rooms a second, prefill ranks only */
} report;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double cpu(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}

static void die(const char *what)
{
    fprintf(stderr, "zmq_floor: %s: %s\n", what, zmq_strerror(zmq_errno()));
    exit(1);
}

static void *open_socket(void *ctx, int type, int bind, int port)
{
    char addr[64];
    int zero = 0;
    void *sock = zmq_socket(ctx, type);
    if (sock == NULL)
        die("zmq_socket");
    int stall = STALL_MS;
    zmq_setsockopt(sock, ZMQ_LINGER_, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO_, &stall, sizeof stall);
    snprintf(addr, sizeof addr, "tcp://127.0.0.1:%d", port);
    if ((bind ? zmq_bind(sock, addr) : zmq_connect(sock, addr)) != 0)
        die(addr);
    return sock;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static report prefill(int rank, int inflight, int rooms, int port)
{
    void *ctx = zmq_ctx_new();
    void *statuses = open_socket(ctx, ZMQ_PULL_, 1, port + 1 + rank);
    void *asks = open_socket(ctx, ZMQ_PUSH_, 0, port);
    int total = WARM + rooms, next = 0, done = 0;
    double *sent = calloc(total, sizeof *sent), *latency = calloc(rooms, sizeof *latency);
    double cpu0 = 0, t0 = 0;
    while (done < total) {
        for (; next < total && next - done < inflight; next++) {
            uint64_t ask[3] = {next, rank, 0x10000u + next};
            sent[next] = now();
            if (zmq_send(asks, ask, sizeof ask, 0) != sizeof ask)
                die("sending an ask");
        }
        uint64_t room;
        if (zmq_recv(statuses, &room, sizeof room, 0) != sizeof room || room >= (uint64_t)total)
            die("receiving a status");
        if (room >= WARM)
            latency[room - WARM] = now() - sent[room];
        if (++done == WARM) {
            cpu0 = cpu();
            t0 = now();
        }
    }
    report out = {cpu() - cpu0, 0, rooms / (now() - t0)};
    qsort(latency, rooms, sizeof *latency, by_value);
    out.p50_s = latency[rooms / 2];
    free(sent);
    free(latency);
    zmq_close(statuses);
    zmq_close(asks);
    zmq_ctx_term(ctx);
    return out;
}

/* Sleeps until `due` (or, when due is 0, until an ask comes), woken early by an ask. */
static void sleep_until(void *asks, double due)
{
    zmq_pollitem_t item = {asks, 0, ZMQ_POLLIN_, 0};
    if (due == 0) {
        if (zmq_poll(&item, 1, STALL_MS) == 0)
            die("no ask came");
        return;
    }
    double wait = due - now();
    if (wait <= 0)
        return;
    if (wait >= 1e-3) {
        zmq_poll(&item, 1, (long)(wait * 1000));  /* zmq_poll counts whole milliseconds */
        return;
    }
    zmq_poll(&item, 1, 0);
    if (!item.revents)
        usleep((useconds_t)(wait * 1e6));
}

static report encode(int fanout, int rooms, int write_us, int port)
{
    void *ctx = zmq_ctx_new();
    void *asks = open_socket(ctx, ZMQ_PULL_, 1, port), *statuses[MAX_FANOUT];
    for (int rank = 0; rank < fanout; rank++)
        statuses[rank] = open_socket(ctx, ZMQ_PUSH_, 0, port + 1 + rank);
    int total = WARM + rooms, head = 0, tail = 0, finished = 0;
    int *asked = calloc(total, sizeof *asked), *ready = calloc(total, sizeof *ready);
    double *due = calloc(total, sizeof *due), cpu0 = 0;
    while (finished < total) {
        sleep_until(asks, head < tail ? due[ready[head]] : 0);
        uint64_t ask[3];
        int got;
        while ((got = zmq_recv(asks, ask, sizeof ask, ZMQ_DONTWAIT_)) >= 0) {
            if (got != sizeof ask || ask[0] >= (uint64_t)total)
                die("a malformed ask");
            if (++asked[ask[0]] == fanout) {
                due[ask[0]] = now() + write_us * 1e-6;
                ready[tail++] = (int)ask[0];
            }
        }
        if (zmq_errno() != EAGAIN)
            die("receiving asks");
        for (double t = now(); head < tail && due[ready[head]] <= t; head++) {
            uint64_t room = ready[head];
            for (int rank = 0; rank < fanout; rank++)
                if (zmq_send(statuses[rank], &room, sizeof room, 0) != sizeof room)
                    die("sending a status");
            if (++finished == WARM)
                cpu0 = cpu();
        }
    }
    report out = {cpu() - cpu0, 0, 0};
    usleep(100000);  /* the last statuses leave before the sockets close */
    free(asked);
    free(ready);
    free(due);
    for (int rank = 0; rank < fanout; rank++)
        zmq_close(statuses[rank]);
    zmq_close(asks);
    zmq_ctx_term(ctx);
    return out;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: zmq_floor FANOUT INFLIGHT ROOMS WRITE_US PORT\n");
        return 2;
    }
    int fanout = atoi(argv[1]), inflight = atoi(argv[2]), rooms = atoi(argv[3]);
    int write_us = atoi(argv[4]), port = atoi(argv[5]);
    if (fanout < 1 || fanout > MAX_FANOUT || inflight < 1 || rooms < 2 || write_us < 0 || port < 1) {
        fprintf(stderr, "zmq_floor: need 1 <= FANOUT <= %d, INFLIGHT >= 1, ROOMS >= 2, WRITE_US >= 0\n",
                MAX_FANOUT);
        return 2;
    }
    int pipes[MAX_FANOUT][2];
    for (int rank = 0; rank < fanout; rank++) {
        if (pipe(pipes[rank]) != 0)
            return 1;
        pid_t pid = fork();
        if (pid < 0)
            return 1;
        if (pid == 0) {
            report r = prefill(rank, inflight, rooms, port);
            return write(pipes[rank][1], &r, sizeof r) == sizeof r ? 0 : 1;
        }
    }
    report enc = encode(fanout, rooms, write_us, port);
    double prefill_cpu = 0, p50 = 0, rate = 1e300;
    for (int rank = 0; rank < fanout; rank++) {
        report r;
        if (read(pipes[rank][0], &r, sizeof r) != sizeof r) {
            fprintf(stderr, "zmq_floor: prefill rank %d reported nothing\n", rank);
            return 1;
        }
        prefill_cpu += r.cpu_s;
        p50 = r.p50_s > p50 ? r.p50_s : p50;
        rate = r.rate < rate ? r.rate : rate;
    }
    int status, failed = 0;
    while (wait(&status) > 0)
        failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    if (failed)
        return 1;
    printf("%d %d %d %.0f %.3f %.3f %.3f %.3f\n", fanout, inflight, write_us, rate, p50 * 1e3,
           (enc.cpu_s + prefill_cpu) / rooms * 1e3, enc.cpu_s / rooms * 1e3, prefill_cpu / rooms * 1e3);
    return 0;
}
