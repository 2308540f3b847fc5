/*
 * A multi-rank stand-in of Biren's libsuccl.so for tests on a host without a
 * SUPA card (built by tests/standin/succl/__init__.py).
 *
 * It exports the entry points vllm_br/device/sccl.py binds, with NCCL
 * semantics and NCCL numbering (dtypes int8 0, uint8 1, int32 2, float32 7,
 * bfloat16 9; ops sum 0, prod 1, max 2, min 3; results 0..7 as ncclResult_t),
 * plus succlStandinCallCount(name), a per-process count of calls per entry
 * point. "Device" pointers are host pointers and the stream is ignored: every
 * call completes before it returns.
 *
 * Transport. The ranks of a communicator are processes of one host:
 *  - the unique id carries a random token; succlCommInitRank maps the POSIX
 *    shared-memory segment "/succl-standin-<token>" (a control block: barrier
 *    counter, one slot per rank, one send/recv channel per ordered rank pair)
 *    and rank 0 unlinks its name once every rank has joined;
 *  - a collective copies the caller's input into the rank's own staging
 *    segment ("-s<rank>-g<generation>", grown on demand), passes a barrier,
 *    reads the peers' staging segments (every rank reduces in rank order, so
 *    all ranks get bit-identical results), and passes a second barrier before
 *    anyone may reuse its staging;
 *  - succlSend writes one segment per message ("-m<src>-<dst>-<seq>") and
 *    returns (unbounded buffering); succlRecv waits for the next sequence
 *    number of its peer pair, copies and unlinks it.
 * Waits sleep on a futex in the shared block (no spinning), wake every 200 ms
 * to notice a peer that exited or destroyed its communicator, and give up
 * after SUCCL_STANDIN_TIMEOUT_S seconds (default 300, read at each wait) with
 * succlRemoteError; a collective that timed out leaves its communicator
 * unusable (as an NCCL error would), a receive that timed out does not;
 * succlGetErrorString then returns the detailed message of the calling
 * thread's last failure (else the generic text of the code). Once every rank
 * destroyed its communicator nothing is left in /dev/shm (a rank that
 * crashes leaves its staging and unread messages there).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

enum {
    succlSuccess = 0,
    succlUnhandledCudaError = 1,
    succlSystemError = 2,
    succlInternalError = 3,
    succlInvalidArgument = 4,
    succlInvalidUsage = 5,
    succlRemoteError = 6,
    succlInProgress = 7,
};

enum { dtInt8 = 0, dtUint8 = 1, dtInt32 = 2, dtFloat32 = 7, dtBfloat16 = 9 };
enum { opSum = 0, opProd = 1, opMax = 2, opMin = 3 };

#define UID_BYTES 128
#define MAX_RANKS 64
#define MAGIC "SUCCL-STANDIN-1"  /* 15 chars + NUL = 16 bytes */
#define COMM_MAGIC 0x5355434cu   /* "SUCL" */
#define SLICE_S 0.2
#define DEFAULT_TIMEOUT_S 300.0

typedef struct {
    char internal[UID_BYTES];
} succlUniqueId;

/* ---- call counters and errors -------------------------------------------- */

enum {
    fnGetErrorString, fnGetUniqueId, fnCommInitRank, fnCommDestroy,
    fnAllReduce, fnAllGather, fnReduceScatter, fnBroadcast, fnSend, fnRecv,
    fnCount
};
static const char* const fn_names[fnCount] = {
    "succlGetErrorString", "succlGetUniqueId", "succlCommInitRank",
    "succlCommDestroy", "succlAllReduce", "succlAllGather",
    "succlReduceScatter", "succlBroadcast", "succlSend", "succlRecv",
};
static _Atomic long call_counts[fnCount];

static void count_call(int fn) { atomic_fetch_add(&call_counts[fn], 1); }

EXPORT int succlStandinCallCount(const char* name) {
    if (name == NULL) return -1;
    for (int i = 0; i < fnCount; i++)
        if (strcmp(name, fn_names[i]) == 0) return (int)atomic_load(&call_counts[i]);
    return -1;
}

static const char* generic_error(int code) {
    switch (code) {
    case succlSuccess: return "no error";
    case succlUnhandledCudaError: return "unhandled device error";
    case succlSystemError: return "unhandled system error";
    case succlInternalError: return "internal error";
    case succlInvalidArgument: return "invalid argument";
    case succlInvalidUsage: return "invalid usage";
    case succlRemoteError: return "remote process exited or did not respond";
    case succlInProgress: return "operation in progress";
    }
    return "unknown result code";
}

static __thread int last_code;
static __thread char last_msg[512];

__attribute__((format(printf, 2, 3))) static int fail(int code, const char* fmt, ...) {
    int n = snprintf(last_msg, sizeof last_msg, "%s: ", generic_error(code));
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof last_msg)
        vsnprintf(last_msg + n, sizeof last_msg - (size_t)n, fmt, ap);
    va_end(ap);
    last_code = code;
    return code;
}

EXPORT const char* succlGetErrorString(int code) {
    count_call(fnGetErrorString);
    if (code != succlSuccess && code == last_code && last_msg[0]) return last_msg;
    return generic_error(code);
}

/* ---- shared state ---------------------------------------------------------- */

typedef struct {
    _Atomic uint32_t pid;     /* 0: not joined */
    _Atomic uint32_t left;    /* 1 once the rank destroyed its communicator */
    _Atomic uint32_t staging_gen;
    _Atomic uint64_t staging_cap;
    /* what the rank's current collective is, checked by its peers */
    uint32_t seq;
    int32_t fn, dtype, op, root;
    uint64_t count;
} slot_t;

typedef struct {
    _Atomic uint32_t sent;      /* futex word: messages sent src -> dst */
    _Atomic uint32_t received;  /* of which dst consumed */
} chan_t;

typedef struct {
    _Atomic int32_t nranks;
    _Atomic uint32_t arrived;   /* futex word: barrier arrivals, ever */
    _Atomic uint32_t destroyed;
    slot_t slots[MAX_RANKS];
    chan_t chans[MAX_RANKS][MAX_RANKS];  /* [src][dst] */
} shared_t;

typedef struct {
    uint32_t gen;
    uint64_t cap;
    void* ptr;
} map_t;

typedef struct succlComm {
    uint32_t magic;
    int rank, nranks;
    int broken;
    uint32_t barriers;  /* barriers this rank passed */
    uint32_t seq;       /* collectives this rank started */
    shared_t* sh;
    char name[64];      /* "/succl-standin-<32 hex>" */
    map_t own;
    map_t peer[MAX_RANKS];
} comm_t;

typedef struct {
    uint64_t nbytes;
    int32_t dtype;
    int32_t pad;
} msg_hdr_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void futex_wait(_Atomic uint32_t* word, uint32_t val, double seconds) {
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t* word) {
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int reached(_Atomic uint32_t* word, uint32_t target) {
    return (int32_t)(atomic_load(word) - target) >= 0;
}

/* A peer (or, with watch < 0, any peer) that is gone: exited, or left the
 * communicator. Returns its rank, or -1. */
static int gone_peer(const comm_t* c, int watch, const char** why) {
    for (int p = 0; p < c->nranks; p++) {
        if (p == c->rank || (watch >= 0 && p != watch)) continue;
        const slot_t* s = &c->sh->slots[p];
        if (atomic_load(&s->left)) {
            *why = "destroyed its communicator";
            return p;
        }
        uint32_t pid = atomic_load(&s->pid);
        if (pid && kill((pid_t)pid, 0) == -1 && errno == ESRCH) {
            *why = "exited";
            return p;
        }
    }
    return -1;
}

static double timeout_from_env(void) {
    const char* raw = getenv("SUCCL_STANDIN_TIMEOUT_S");
    if (raw == NULL || !*raw) return DEFAULT_TIMEOUT_S;
    char* end = NULL;
    double v = strtod(raw, &end);
    if (end == raw || *end || !(v > 0)) return DEFAULT_TIMEOUT_S;
    return v;
}

/* Sleep until *word reaches target (wrapping compare); error after the
 * timeout or when the peer(s) we wait for are gone. */
static int wait_reach(comm_t* c, _Atomic uint32_t* word, uint32_t target, int watch,
                      const char* fn, const char* what) {
    double timeout_s = timeout_from_env();
    double deadline = now_s() + timeout_s;
    for (;;) {
        uint32_t v = atomic_load(word);
        if ((int32_t)(v - target) >= 0) return succlSuccess;
        const char* why = NULL;
        int p = gone_peer(c, watch, &why);
        if (p >= 0) {
            if (reached(word, target)) return succlSuccess;
            return fail(succlRemoteError, "%s on rank %d of %d: rank %d %s while this rank waited for %s",
                        fn, c->rank, c->nranks, p, why, what);
        }
        double left = deadline - now_s();
        if (left <= 0)
            return fail(succlRemoteError,
                        "%s on rank %d of %d timed out after %g s waiting for %s (SUCCL_STANDIN_TIMEOUT_S)",
                        fn, c->rank, c->nranks, timeout_s, what);
        futex_wait(word, v, left < SLICE_S ? left : SLICE_S);
    }
}

/* All ranks meet. On failure the rank withdraws its arrival, unless every
 * rank arrived meanwhile (then the barrier succeeded after all). */
static int barrier(comm_t* c, const char* fn, const char* what) {
    shared_t* sh = c->sh;
    uint32_t target = (c->barriers + 1) * (uint32_t)c->nranks;
    atomic_fetch_add(&sh->arrived, 1);
    futex_wake(&sh->arrived);
    int rc = wait_reach(c, &sh->arrived, target, -1, fn, what);
    if (rc != succlSuccess) {
        for (;;) {
            uint32_t v = atomic_load(&sh->arrived);
            if ((int32_t)(v - target) >= 0) {
                rc = succlSuccess;
                break;
            }
            if (atomic_compare_exchange_weak(&sh->arrived, &v, v - 1)) break;
        }
    }
    if (rc == succlSuccess) c->barriers++;
    return rc;
}

/* ---- unique id and segments ---------------------------------------------- */

EXPORT int succlGetUniqueId(succlUniqueId* id) {
    count_call(fnGetUniqueId);
    if (id == NULL) return fail(succlInvalidArgument, "succlGetUniqueId: id is NULL");
    memset(id, 0, sizeof *id);
    memcpy(id->internal, MAGIC, sizeof MAGIC);
    unsigned char* token = (unsigned char*)id->internal + 16;
    ssize_t got = getrandom(token, 16, 0);
    if (got != 16) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t a = (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32);
        uint64_t b = (uint64_t)ts.tv_sec ^ (uint64_t)(uintptr_t)id;
        memcpy(token, &a, 8);
        memcpy(token + 8, &b, 8);
    }
    uint32_t pid = (uint32_t)getpid();
    memcpy(id->internal + 32, &pid, 4);
    return succlSuccess;
}

static void segment_name(char* out, size_t n, const char* base, const char* fmt, ...) {
    char tail[48];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tail, sizeof tail, fmt, ap);
    va_end(ap);
    snprintf(out, n, "%s%s", base, tail);
}

static void* map_segment(const char* name, uint64_t size, int create) {
    int fd = shm_open(name, O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
    if (fd < 0) return NULL;
    if (create && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        shm_unlink(name);
        return NULL;
    }
    void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        if (create) shm_unlink(name);
        return NULL;
    }
    return p;
}

static int ensure_staging(comm_t* c, uint64_t need, const char* fn) {
    if (need <= c->own.cap) return succlSuccess;
    uint64_t cap = c->own.cap * 2;
    if (cap < need) cap = need;
    if (cap < 65536) cap = 65536;
    cap = (cap + 4095) & ~(uint64_t)4095;
    uint32_t gen = c->own.gen + 1;
    char name[96];
    segment_name(name, sizeof name, c->name, "-s%d-g%u", c->rank, gen);
    void* p = map_segment(name, cap, 1);
    if (p == NULL)
        return fail(succlSystemError, "%s on rank %d: cannot create shared memory %s of %llu bytes (%s)",
                    fn, c->rank, name, (unsigned long long)cap, strerror(errno));
    if (c->own.ptr) {
        char old[96];
        segment_name(old, sizeof old, c->name, "-s%d-g%u", c->rank, c->own.gen);
        munmap(c->own.ptr, c->own.cap);
        shm_unlink(old);
    }
    c->own = (map_t){gen, cap, p};
    slot_t* s = &c->sh->slots[c->rank];
    atomic_store(&s->staging_cap, cap);
    atomic_store(&s->staging_gen, gen);
    return succlSuccess;
}

/* The staging segment of peer p (after the first barrier of a collective). */
static const void* peer_staging(comm_t* c, int p, uint64_t need, const char* fn, int* rc) {
    if (p == c->rank) return c->own.ptr;
    slot_t* s = &c->sh->slots[p];
    uint32_t gen = atomic_load(&s->staging_gen);
    uint64_t cap = atomic_load(&s->staging_cap);
    map_t* m = &c->peer[p];
    if (m->ptr == NULL || m->gen != gen) {
        if (m->ptr) munmap(m->ptr, m->cap);
        *m = (map_t){0, 0, NULL};
        char name[96];
        segment_name(name, sizeof name, c->name, "-s%d-g%u", p, gen);
        void* ptr = gen ? map_segment(name, cap, 0) : NULL;
        if (ptr == NULL) {
            *rc = fail(succlInternalError, "%s on rank %d: cannot map the staging memory %s of rank %d (%s)",
                       fn, c->rank, name, p, gen ? strerror(errno) : "none published");
            return NULL;
        }
        *m = (map_t){gen, cap, ptr};
    }
    if (m->cap < need) {
        *rc = fail(succlInternalError, "%s on rank %d: rank %d staged %llu bytes, %llu needed",
                   fn, c->rank, p, (unsigned long long)m->cap, (unsigned long long)need);
        return NULL;
    }
    return m->ptr;
}

/* ---- dtypes and reduction --------------------------------------------------- */

static size_t dtype_size(int dt) {
    switch (dt) {
    case dtInt8: case dtUint8: return 1;
    case dtInt32: case dtFloat32: return 4;
    case dtBfloat16: return 2;
    }
    return 0;
}

static int check_dtype(int dt, const char* fn) {
    if (dtype_size(dt)) return succlSuccess;
    return fail(succlInvalidArgument,
                "%s: data type %d is not supported (the stand-in takes int8 0, uint8 1, int32 2, float32 7, bfloat16 9)",
                fn, dt);
}

static int check_op(int op, const char* fn) {
    if (op >= opSum && op <= opMin) return succlSuccess;
    return fail(succlInvalidArgument, "%s: reduce op %d is not supported (sum 0, prod 1, max 2, min 3)", fn, op);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define CHUNK 1024

static void load_f(float* acc, const void* src, size_t n, int dt) {
    if (dt == dtFloat32) {
        memcpy(acc, src, n * 4);
    } else {
        const uint16_t* s = src;
        for (size_t i = 0; i < n; i++) acc[i] = bf16_to_f32(s[i]);
    }
}

static void load_i(int64_t* acc, const void* src, size_t n, int dt) {
    for (size_t i = 0; i < n; i++) {
        switch (dt) {
        case dtInt8: acc[i] = ((const int8_t*)src)[i]; break;
        case dtUint8: acc[i] = ((const uint8_t*)src)[i]; break;
        default: acc[i] = ((const int32_t*)src)[i]; break;
        }
    }
}

/* out[i] = in[0][i] op in[1][i] op ... in rank order; float types accumulate
 * in float32 (bfloat16 rounds once, at the end); integers wrap. */
static void reduce(void* out, const void* const* in, int n, size_t count, int dt, int op) {
    size_t es = dtype_size(dt);
    int is_float = dt == dtFloat32 || dt == dtBfloat16;
    float fa[CHUNK], fb[CHUNK];
    int64_t ia[CHUNK], ib[CHUNK];
    for (size_t base = 0; base < count; base += CHUNK) {
        size_t m = count - base < CHUNK ? count - base : CHUNK;
        if (is_float) {
            load_f(fa, (const char*)in[0] + base * es, m, dt);
            for (int r = 1; r < n; r++) {
                load_f(fb, (const char*)in[r] + base * es, m, dt);
                for (size_t i = 0; i < m; i++) {
                    switch (op) {
                    case opSum: fa[i] += fb[i]; break;
                    case opProd: fa[i] *= fb[i]; break;
                    case opMax: fa[i] = fb[i] > fa[i] ? fb[i] : fa[i]; break;
                    default: fa[i] = fb[i] < fa[i] ? fb[i] : fa[i]; break;
                    }
                }
            }
            if (dt == dtFloat32) {
                memcpy((char*)out + base * es, fa, m * 4);
            } else {
                uint16_t* o = (uint16_t*)((char*)out + base * es);
                for (size_t i = 0; i < m; i++) o[i] = f32_to_bf16(fa[i]);
            }
        } else {
            load_i(ia, (const char*)in[0] + base * es, m, dt);
            for (int r = 1; r < n; r++) {
                load_i(ib, (const char*)in[r] + base * es, m, dt);
                for (size_t i = 0; i < m; i++) {
                    switch (op) {
                    case opSum: ia[i] = (int64_t)((uint64_t)ia[i] + (uint64_t)ib[i]); break;
                    case opProd: ia[i] = (int64_t)((uint64_t)ia[i] * (uint64_t)ib[i]); break;
                    case opMax: ia[i] = ib[i] > ia[i] ? ib[i] : ia[i]; break;
                    default: ia[i] = ib[i] < ia[i] ? ib[i] : ia[i]; break;
                    }
                }
            }
            char* o = (char*)out + base * es;
            for (size_t i = 0; i < m; i++) {
                uint64_t v = (uint64_t)ia[i];
                switch (dt) {
                case dtInt8: case dtUint8: ((uint8_t*)o)[i] = (uint8_t)v; break;
                default: ((uint32_t*)o)[i] = (uint32_t)v; break;
                }
            }
        }
    }
}

/* ---- communicator ----------------------------------------------------------- */

static int check_comm(comm_t* c, const char* fn) {
    if (c == NULL || c->magic != COMM_MAGIC)
        return fail(succlInvalidArgument, "%s: not a communicator (NULL or destroyed)", fn);
    if (c->broken)
        return fail(succlInvalidUsage, "%s on rank %d: the communicator failed earlier and cannot be used",
                    fn, c->rank);
    return succlSuccess;
}

EXPORT int succlCommInitRank(comm_t** out, int nranks, succlUniqueId id, int rank) {
    const char* fn = "succlCommInitRank";
    count_call(fnCommInitRank);
    if (out == NULL) return fail(succlInvalidArgument, "%s: comm is NULL", fn);
    if (nranks < 1 || nranks > MAX_RANKS)
        return fail(succlInvalidArgument, "%s: nranks %d is not in 1..%d", fn, nranks, MAX_RANKS);
    if (rank < 0 || rank >= nranks)
        return fail(succlInvalidArgument, "%s: rank %d is not in 0..%d", fn, rank, nranks - 1);
    if (memcmp(id.internal, MAGIC, sizeof MAGIC) != 0)
        return fail(succlInvalidArgument, "%s: the unique id was not made by this library's succlGetUniqueId", fn);

    int rc = succlSuccess;
    comm_t* c = calloc(1, sizeof *c);
    if (c == NULL) return fail(succlSystemError, "%s: out of memory", fn);
    c->rank = rank;
    c->nranks = nranks;
    int n = snprintf(c->name, sizeof c->name, "/succl-standin-");
    const unsigned char* token = (const unsigned char*)id.internal + 16;
    for (int i = 0; i < 16; i++) n += snprintf(c->name + n, sizeof c->name - (size_t)n, "%02x", token[i]);

    int fd = shm_open(c->name, O_RDWR | O_CREAT, 0600);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 ||
        ((size_t)st.st_size < sizeof(shared_t) && ftruncate(fd, sizeof(shared_t)) != 0)) {
        int e = errno;
        if (fd >= 0) close(fd);
        rc = fail(succlSystemError, "%s: cannot open shared memory %s (%s)", fn, c->name, strerror(e));
        free(c);
        return rc;
    }
    shared_t* sh = mmap(NULL, sizeof(shared_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (sh == MAP_FAILED) {
        int e = errno;
        free(c);
        return fail(succlSystemError, "%s: cannot map shared memory (%s)", fn, strerror(e));
    }
    c->sh = sh;

    int32_t expect = 0;
    if (!atomic_compare_exchange_strong(&sh->nranks, &expect, nranks) && expect != nranks) {
        rc = fail(succlInvalidUsage, "%s: rank %d says %d ranks, another rank of this unique id said %d",
                  fn, rank, nranks, expect);
    } else {
        uint32_t none = 0;
        if (!atomic_compare_exchange_strong(&sh->slots[rank].pid, &none, (uint32_t)getpid()))
            rc = fail(succlInvalidUsage, "%s: rank %d of this unique id joined twice (pid %u and pid %d)",
                      fn, rank, none, (int)getpid());
        else if ((rc = barrier(c, fn, "every rank to join")) != succlSuccess)
            atomic_store(&sh->slots[rank].pid, 0);
    }
    if (rc != succlSuccess) {
        /* the name goes: a late peer makes a fresh segment and times out too */
        shm_unlink(c->name);
        munmap(sh, sizeof(shared_t));
        free(c);
        return rc;
    }
    if (rank == 0) shm_unlink(c->name);  /* every rank has it mapped */
    c->magic = COMM_MAGIC;
    *out = c;
    return succlSuccess;
}

static void unlink_messages(comm_t* c, int src, int dst) {
    chan_t* ch = &c->sh->chans[src][dst];
    uint32_t sent = atomic_load(&ch->sent);
    for (uint32_t s = atomic_load(&ch->received); s != sent; s++) {
        char name[96];
        segment_name(name, sizeof name, c->name, "-m%d-%d-%u", src, dst, s);
        shm_unlink(name);
    }
    atomic_store(&ch->received, sent);
}

EXPORT int succlCommDestroy(comm_t* c) {
    const char* fn = "succlCommDestroy";
    count_call(fnCommDestroy);
    if (c == NULL || c->magic != COMM_MAGIC)
        return fail(succlInvalidArgument, "%s: not a communicator (NULL or destroyed)", fn);
    shared_t* sh = c->sh;
    for (int p = 0; p < c->nranks; p++) {
        unlink_messages(c, p, c->rank);  /* never to be received */
        if (c->peer[p].ptr) munmap(c->peer[p].ptr, c->peer[p].cap);
    }
    if (c->own.ptr) {
        char name[96];
        segment_name(name, sizeof name, c->name, "-s%d-g%u", c->rank, c->own.gen);
        munmap(c->own.ptr, c->own.cap);
        shm_unlink(name);
    }
    atomic_store(&sh->slots[c->rank].left, 1);
    futex_wake(&sh->arrived);
    for (int p = 0; p < c->nranks; p++) futex_wake(&sh->chans[c->rank][p].sent);
    if ((int)atomic_fetch_add(&sh->destroyed, 1) + 1 == c->nranks) {
        /* the last one: messages sent to ranks that had already left */
        for (int s = 0; s < c->nranks; s++)
            for (int d = 0; d < c->nranks; d++) unlink_messages(c, s, d);
        shm_unlink(c->name);
    }
    munmap(sh, sizeof(shared_t));
    c->magic = 0;
    free(c);
    return succlSuccess;
}

/* ---- collectives ------------------------------------------------------------ */

/* Stage `bytes` of `src`, publish what this call is, and meet the peers. */
static int coll_begin(comm_t* c, int fn, const void* src, uint64_t bytes, size_t count,
                      int dt, int op, int root) {
    const char* name = fn_names[fn];
    int rc = ensure_staging(c, bytes, name);
    if (rc != succlSuccess) return rc;
    if (bytes) memcpy(c->own.ptr, src, bytes);
    slot_t* s = &c->sh->slots[c->rank];
    s->seq = ++c->seq;
    s->fn = fn;
    s->count = count;
    s->dtype = dt;
    s->op = op;
    s->root = root;
    rc = barrier(c, name, "every rank to join the collective");
    if (rc != succlSuccess) {
        c->broken = 1;
        return rc;
    }
    for (int p = 0; p < c->nranks; p++) {
        const slot_t* o = &c->sh->slots[p];
        if (o->seq != s->seq || o->fn != fn || o->count != count || o->dtype != dt ||
            o->op != op || o->root != root)
            return fail(succlInvalidUsage,
                        "%s on rank %d (collective #%u, count %zu, dtype %d, op %d, root %d) "
                        "met rank %d in %s (collective #%u, count %llu, dtype %d, op %d, root %d)",
                        name, c->rank, s->seq, count, dt, op, root, p, fn_names[o->fn], o->seq,
                        (unsigned long long)o->count, o->dtype, o->op, o->root);
    }
    return succlSuccess;
}

/* Nobody reuses its staging before every rank has read it. */
static int coll_end(comm_t* c, int fn, int rc) {
    int rc2 = barrier(c, fn_names[fn], "every rank to finish the collective");
    if (rc2 != succlSuccess) c->broken = 1;
    return rc != succlSuccess ? rc : rc2;
}

static int check_buffers(const void* send, const void* recv, size_t count, const char* fn) {
    if (count && (send == NULL || recv == NULL))
        return fail(succlInvalidArgument, "%s: NULL buffer for %zu elements", fn, count);
    return succlSuccess;
}

EXPORT int succlAllReduce(const void* send, void* recv, size_t count, int dt, int op, comm_t* c,
                          void* stream) {
    (void)stream;
    const int fn = fnAllReduce;
    const char* name = fn_names[fn];
    count_call(fn);
    int rc;
    if ((rc = check_comm(c, name)) || (rc = check_dtype(dt, name)) || (rc = check_op(op, name)) ||
        (rc = check_buffers(send, recv, count, name)))
        return rc;
    uint64_t bytes = (uint64_t)count * dtype_size(dt);
    if ((rc = coll_begin(c, fn, send, bytes, count, dt, op, -1)) == succlSuccess && count) {
        const void* in[MAX_RANKS];
        for (int p = 0; p < c->nranks && rc == succlSuccess; p++)
            in[p] = peer_staging(c, p, bytes, name, &rc);
        if (rc == succlSuccess) reduce(recv, in, c->nranks, count, dt, op);
    }
    return c->broken ? rc : coll_end(c, fn, rc);
}

EXPORT int succlAllGather(const void* send, void* recv, size_t count, int dt, comm_t* c,
                          void* stream) {
    (void)stream;
    const int fn = fnAllGather;
    const char* name = fn_names[fn];
    count_call(fn);
    int rc;
    if ((rc = check_comm(c, name)) || (rc = check_dtype(dt, name)) ||
        (rc = check_buffers(send, recv, count, name)))
        return rc;
    uint64_t bytes = (uint64_t)count * dtype_size(dt);
    if ((rc = coll_begin(c, fn, send, bytes, count, dt, -1, -1)) == succlSuccess && count) {
        for (int p = 0; p < c->nranks && rc == succlSuccess; p++) {
            const void* src = peer_staging(c, p, bytes, name, &rc);
            if (src) memcpy((char*)recv + (size_t)p * bytes, src, bytes);
        }
    }
    return c->broken ? rc : coll_end(c, fn, rc);
}

EXPORT int succlReduceScatter(const void* send, void* recv, size_t count, int dt, int op,
                              comm_t* c, void* stream) {
    (void)stream;
    const int fn = fnReduceScatter;
    const char* name = fn_names[fn];
    count_call(fn);
    int rc;
    if ((rc = check_comm(c, name)) || (rc = check_dtype(dt, name)) || (rc = check_op(op, name)) ||
        (rc = check_buffers(send, recv, count, name)))
        return rc;
    uint64_t block = (uint64_t)count * dtype_size(dt);
    uint64_t bytes = block * (uint64_t)c->nranks;
    if ((rc = coll_begin(c, fn, send, bytes, count, dt, op, -1)) == succlSuccess && count) {
        const void* in[MAX_RANKS];
        for (int p = 0; p < c->nranks && rc == succlSuccess; p++) {
            const char* base = peer_staging(c, p, bytes, name, &rc);
            in[p] = base ? base + (size_t)c->rank * block : NULL;
        }
        if (rc == succlSuccess) reduce(recv, in, c->nranks, count, dt, op);
    }
    return c->broken ? rc : coll_end(c, fn, rc);
}

EXPORT int succlBroadcast(const void* send, void* recv, size_t count, int dt, int root,
                          comm_t* c, void* stream) {
    (void)stream;
    const int fn = fnBroadcast;
    const char* name = fn_names[fn];
    count_call(fn);
    int rc;
    if ((rc = check_comm(c, name)) || (rc = check_dtype(dt, name)))
        return rc;
    if (root < 0 || root >= c->nranks)
        return fail(succlInvalidArgument, "%s: root %d is not in 0..%d", name, root, c->nranks - 1);
    if (count && recv == NULL) return fail(succlInvalidArgument, "%s: recvbuff is NULL", name);
    if (count && c->rank == root && send == NULL)
        return fail(succlInvalidArgument, "%s: the root's sendbuff is NULL", name);
    uint64_t bytes = (uint64_t)count * dtype_size(dt);
    int is_root = c->rank == root;
    if ((rc = coll_begin(c, fn, send, is_root ? bytes : 0, count, dt, -1, root)) == succlSuccess &&
        count) {
        if (is_root) {
            if (send != recv) memmove(recv, send, bytes);
        } else {
            const void* src = peer_staging(c, root, bytes, name, &rc);
            if (src) memcpy(recv, src, bytes);
        }
    }
    return c->broken ? rc : coll_end(c, fn, rc);
}

/* ---- point to point ----------------------------------------------------------- */

static int check_peer(comm_t* c, int peer, const char* fn) {
    if (peer < 0 || peer >= c->nranks)
        return fail(succlInvalidArgument, "%s on rank %d: peer %d is not in 0..%d", fn, c->rank, peer,
                    c->nranks - 1);
    return succlSuccess;
}

EXPORT int succlSend(const void* send, size_t count, int dt, int peer, comm_t* c, void* stream) {
    (void)stream;
    const char* fn = fn_names[fnSend];
    count_call(fnSend);
    int rc;
    if ((rc = check_comm(c, fn)) || (rc = check_dtype(dt, fn)) || (rc = check_peer(c, peer, fn)) ||
        (rc = check_buffers(send, send, count, fn)))
        return rc;
    chan_t* ch = &c->sh->chans[c->rank][peer];
    uint32_t seq = atomic_load(&ch->sent);  /* only this rank writes it */
    uint64_t bytes = (uint64_t)count * dtype_size(dt);
    char name[96];
    segment_name(name, sizeof name, c->name, "-m%d-%d-%u", c->rank, peer, seq);
    msg_hdr_t* m = map_segment(name, sizeof(msg_hdr_t) + bytes, 1);
    if (m == NULL)
        return fail(succlSystemError, "%s on rank %d: cannot create shared memory %s of %llu bytes (%s)",
                    fn, c->rank, name, (unsigned long long)(sizeof(msg_hdr_t) + bytes), strerror(errno));
    m->nbytes = bytes;
    m->dtype = dt;
    if (bytes) memcpy(m + 1, send, bytes);
    munmap(m, sizeof(msg_hdr_t) + bytes);
    atomic_store(&ch->sent, seq + 1);
    futex_wake(&ch->sent);
    return succlSuccess;
}

EXPORT int succlRecv(void* recv, size_t count, int dt, int peer, comm_t* c, void* stream) {
    (void)stream;
    const char* fn = fn_names[fnRecv];
    count_call(fnRecv);
    int rc;
    if ((rc = check_comm(c, fn)) || (rc = check_dtype(dt, fn)) || (rc = check_peer(c, peer, fn)) ||
        (rc = check_buffers(recv, recv, count, fn)))
        return rc;
    chan_t* ch = &c->sh->chans[peer][c->rank];
    uint32_t seq = atomic_load(&ch->received);  /* only this rank writes it */
    char what[64];
    snprintf(what, sizeof what, "message #%u from rank %d", seq, peer);
    if ((rc = wait_reach(c, &ch->sent, seq + 1, peer, fn, what)) != succlSuccess) return rc;
    char name[96];
    segment_name(name, sizeof name, c->name, "-m%d-%d-%u", peer, c->rank, seq);
    int fd = shm_open(name, O_RDWR, 0600);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(msg_hdr_t)) {
        int e = errno;
        if (fd >= 0) close(fd);
        return fail(succlInternalError, "%s on rank %d: cannot open message %s (%s)", fn, c->rank, name,
                    strerror(e));
    }
    size_t size = (size_t)st.st_size;
    msg_hdr_t* m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return fail(succlSystemError, "%s on rank %d: cannot map message %s (%s)", fn, c->rank, name,
                    strerror(errno));
    uint64_t want = (uint64_t)count * dtype_size(dt);
    if (m->nbytes != want)
        rc = fail(succlInvalidUsage, "%s on rank %d: rank %d sent %llu bytes, this receive takes %llu",
                  fn, c->rank, peer, (unsigned long long)m->nbytes, (unsigned long long)want);
    else if (want)
        memcpy(recv, m + 1, want);
    munmap(m, size);
    shm_unlink(name);
    atomic_store(&ch->received, seq + 1);
    return rc;
}
