/* The segment store's batch loops in C: a batch's runs of records read or written with one
 * preadv / pwritev each and every record hashed, on the calling thread and helper threads, all
 * without Python's GIL (the caller goes through ctypes, which releases it for the whole call).
 *
 * Built on first use by kvtier.storage.segments.native with the system C compiler; the store
 * runs the same loops in Python where no compiler is found. No Python API is used here.
 *
 * Records: arrays indexed by record, in file order within each run. A run is `count` records
 * lying back to back in one file from `offset`. Record k is `rlen[k]` bytes, the concatenation
 * of its parts pstart[k] .. pstart[k+1]-1, part p at `paddr[p]`, `plen[p]` bytes (a page_first
 * KV page: its K range and its V range); without `pstart` (NULL) part k is record k. Buffers
 * next to each other in memory become one iovec. The checksum is XXH3-64 of a record's bytes,
 * through the function pointers the caller passes (the xxhash binding's own: one-shot for a
 * record of one part, streaming for one of several and for a large record read, or hashed and
 * written, in pieces), so both paths hash with the same code.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define KVT_ABI 5
#define KVT_IOV 1024   /* iovecs per syscall (Linux's IOV_MAX) */
#define KVT_THREADS 8  /* most threads one call uses, the caller's included */

typedef uint64_t (*kvt_hash)(const void *, size_t);

/* XXH3-64's streaming calls, the binding's own (XXH3_createState, _freeState, _64bits_reset,
 * _64bits_update, _64bits_digest): a large record is hashed piece by piece as it lands (a read)
 * or goes (a write). */
typedef struct {
    void *(*create)(void);
    int (*destroy)(void *);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    uint64_t (*digest)(const void *);
} kvt_stream;

typedef struct {
    int64_t offset; /* file offset of the run's first record */
    int32_t fd;
    int32_t first;  /* first record */
    int32_t count;  /* records */
    int32_t err;    /* out: 0, or the errno of a failed syscall (the run's records unserved) */
} kvt_run;

int kvt_abi(void) { return KVT_ABI; }

/* A batch's records and their parts (see the top of this file). */
typedef struct {
    const uint64_t *rlen;   /* bytes of each record */
    const int64_t *pstart;  /* NULL, or record k's parts: pstart[k] .. pstart[k+1]-1 */
    const uint64_t *paddr, *plen;
} kvt_recs;

static inline int64_t part0(const kvt_recs *rs, int k) { return rs->pstart ? rs->pstart[k] : k; }
static inline int64_t part1(const kvt_recs *rs, int k) { return rs->pstart ? rs->pstart[k + 1] : k + 1; }

/* A thread's hasher: one-shot XXH3 for a record of one part, the streaming calls (a state of
 * this thread's own, made on first need) for one of several. */
typedef struct {
    kvt_hash hash;
    const kvt_stream *stream;
    void *state;
    int failed; /* out: a record's state could not be made (no memory): its checksum is void */
} kvt_hasher;

static uint64_t hash_record(const kvt_recs *rs, kvt_hasher *h, int k) {
    int64_t a = part0(rs, k), b = part1(rs, k);
    if (b - a == 1) return h->hash((void *)(uintptr_t)rs->paddr[a], rs->plen[a]);
    /* Several parts (the entry points refuse them without a stream), or none: as one stream. */
    if (!h->state) h->state = h->stream->create();
    if (!h->state || h->stream->reset(h->state) != 0) {
        h->failed = 1;
        return 0;
    }
    for (int64_t p = a; p < b; p++)
        if (rs->plen[p]) h->stream->update(h->state, (void *)(uintptr_t)rs->paddr[p], rs->plen[p]);
    return h->stream->digest(h->state);
}

static void hasher_done(kvt_hasher *h) {
    if (h->state) h->stream->destroy(h->state);
    h->state = NULL;
}

/* The run's buffers from record `from` as iovecs, neighbours in memory merged, whole records
 * only; how many (at most `cap`; records beyond go in the next syscall of the run), or -1 if
 * record `from` alone has more than `cap` parts. *upto: the record after the last taken. */
static int fill(const kvt_run *r, const kvt_recs *rs, int from, struct iovec *iov, int cap,
                int *upto) {
    int n = 0, i = from, end = r->first + r->count;
    for (; i < end; i++) {
        int64_t a = part0(rs, i), b = part1(rs, i);
        if (n + (b - a) > cap) { /* counted before merging: it may have fit */
            if (i == from) return -1;
            break;
        }
        for (int64_t p = a; p < b; p++) {
            uint64_t len = rs->plen[p];
            if (!len) continue;
            char *at = (char *)(uintptr_t)rs->paddr[p];
            if (n && (char *)iov[n - 1].iov_base + iov[n - 1].iov_len == at) {
                iov[n - 1].iov_len += len;
                continue;
            }
            iov[n].iov_base = at;
            iov[n].iov_len = len;
            n++;
        }
    }
    *upto = i;
    return n;
}

/* Move `want` bytes between iov[0..n) and the file from `offset`, continuing short transfers;
 * the bytes moved (fewer only at the end of the file on a read), or -errno. */
static int64_t move_all(int write, int fd, struct iovec *iov, int n, int64_t offset,
                        int64_t want) {
    int64_t done = 0;
    while (done < want) {
        ssize_t got = write ? pwritev(fd, iov, n, offset + done) : preadv(fd, iov, n, offset + done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) {
            if (write) return -EIO;
            break; /* the file ends here */
        }
        done += got;
        while (n && (size_t)got >= iov->iov_len) { /* drop what moved */
            got -= iov->iov_len;
            iov++;
            n--;
        }
        if (n) {
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= got;
        }
    }
    return done;
}

typedef struct {
    int write;
    kvt_run *runs;
    int nruns;
    kvt_recs recs;
    uint64_t *sums;    /* read: each record's expected checksum; write: out, each's checksum */
    uint8_t *status;   /* read only, out: 1 served, 2 failed verification, 0 not read */
    kvt_hash hash;
    int next;          /* the next run nobody took */
    int64_t piece;     /* a record larger than this is read, or hashed and written on one
                          thread, in pieces of this size (0: whole) */
    const kvt_stream *stream; /* records of several parts; a read's pieces as they land (NULL:
                                 one part each, and a large record hashed whole, after) */
    const uint8_t *trusted;   /* read only, or NULL: records served without a check (verify once) */
    int hashed;        /* write only: another thread hashes the records (hash_all) */
    int after;         /* write only, hashed here: each run (piece) hashed right after its write,
                          from this core's cache, instead of just before it */
    int unhashed;      /* write, out: a record could not be hashed (no memory for a state) */
} kvt_job;

/* A large record read in sequential pieces of at most job->piece bytes, part by part, each
 * piece hashed as it lands where a stream is given: one request of the whole record read cold
 * measured 84% of raw against 100% in pieces (H100 host). */
static void read_in_pieces(kvt_job *job, kvt_hasher *h, kvt_run *r, int i) {
    const kvt_recs *rs = &job->recs;
    const kvt_stream *st = job->stream;
    int check = !(job->trusted && job->trusted[i]);
    void *state = st && check ? st->create() : NULL;
    if (state && st->reset(state) != 0) {
        st->destroy(state);
        state = NULL;
    }
    int64_t n = (int64_t)rs->rlen[i], done = 0;
    for (int64_t p = part0(rs, i); p < part1(rs, i) && done < n; p++) {
        char *a = (char *)(uintptr_t)rs->paddr[p];
        int64_t size = (int64_t)rs->plen[p], in = 0;
        while (in < size) {
            int64_t step = size - in < job->piece ? size - in : job->piece;
            ssize_t got = pread(r->fd, a + in, (size_t)step, r->offset + done);
            if (got < 0) {
                if (errno == EINTR) continue;
                r->err = errno;
                job->status[i] = 3;
                if (state) st->destroy(state);
                return;
            }
            if (got == 0) goto short_read; /* the file ends inside the record */
            if (state && st->update(state, a + in, (size_t)got) != 0) { /* never: hash after */
                st->destroy(state);
                state = NULL;
            }
            in += got;
            done += got;
        }
    }
short_read:;
    uint64_t sum = 0;
    if (done == n && check) sum = state ? st->digest(state) : hash_record(rs, h, i);
    if (state) st->destroy(state);
    job->status[i] = done < n ? 2 : h->failed ? 3 : !check || sum == job->sums[i] ? 1 : 2;
    h->failed = 0;
}

/* A large record hashed and written on this thread in sequential pieces of at most job->piece
 * bytes, part by part, each piece hashed just before it is written: the write then copies it
 * from this core's cache instead of reading the record from memory a second time (hashed
 * whole first, a 2 MiB record no longer fits the core's cache). Needs the streaming calls;
 * the caller checks. Sets the record's checksum, or the run's errno; 0, or -1 if no hash state
 * could be made (nothing written: the caller writes it whole). */
static int write_in_pieces(kvt_job *job, kvt_hasher *h, kvt_run *r, int i) {
    const kvt_recs *rs = &job->recs;
    const kvt_stream *st = job->stream;
    if (!h->state) h->state = st->create();
    if (!h->state || st->reset(h->state) != 0) return -1;
    int64_t pos = r->offset;
    for (int64_t p = part0(rs, i); p < part1(rs, i); p++) {
        char *a = (char *)(uintptr_t)rs->paddr[p];
        int64_t size = (int64_t)rs->plen[p];
        for (int64_t in = 0; in < size;) {
            int64_t step = size - in < job->piece ? size - in : job->piece;
            if (!job->after && st->update(h->state, a + in, (size_t)step) != 0)
                __atomic_store_n(&job->unhashed, 1, __ATOMIC_RELAXED);
            struct iovec one = {a + in, (size_t)step};
            int64_t got = move_all(1, r->fd, &one, 1, pos, step);
            if (got < 0) {
                r->err = (int)-got;
                return 0;
            }
            if (job->after && st->update(h->state, a + in, (size_t)step) != 0)
                __atomic_store_n(&job->unhashed, 1, __ATOMIC_RELAXED);
            in += step;
            pos += step;
        }
    }
    job->sums[i] = st->digest(h->state);
    return 0;
}

static void one_run(kvt_job *job, kvt_hasher *h, kvt_run *r) {
    struct iovec iov[KVT_IOV];
    const kvt_recs *rs = &job->recs;
    int end = r->first + r->count, i = r->first;
    int64_t pos = r->offset;
    if (job->write && !job->hashed && r->count == 1 && job->piece > 0 && job->stream &&
        (int64_t)rs->rlen[i] > job->piece && write_in_pieces(job, h, r, i) == 0)
        return;
    if (job->write && !job->hashed && !job->after) { /* the write copies from this core's cache */
        for (int k = r->first; k < end; k++) job->sums[k] = hash_record(rs, h, k);
        if (h->failed) __atomic_store_n(&job->unhashed, 1, __ATOMIC_RELAXED);
    }
    if (!job->write && r->count == 1 && job->piece > 0 && (int64_t)rs->rlen[i] > job->piece) {
        read_in_pieces(job, h, r, i);
        return;
    }
    while (i < end) {
        int upto, n = fill(r, rs, i, iov, KVT_IOV, &upto);
        if (n < 0) { /* one record of more parts than a syscall takes: the callers never pass it */
            r->err = EINVAL;
            if (!job->write)
                for (int k = i; k < end; k++) job->status[k] = 3;
            return;
        }
        int64_t want = 0;
        for (int k = i; k < upto; k++) want += rs->rlen[k];
        int64_t got = n ? move_all(job->write, r->fd, iov, n, pos, want) : 0;
        if (got < 0) { /* this syscall's records (and the run's rest) are not moved */
            r->err = (int)-got;
            if (!job->write)
                for (int k = i; k < end; k++) job->status[k] = 3;
            return;
        }
        if (job->write && !job->hashed && job->after) {
            for (int k = i; k < upto; k++) job->sums[k] = hash_record(rs, h, k);
            if (h->failed) __atomic_store_n(&job->unhashed, 1, __ATOMIC_RELAXED);
        }
        if (!job->write) {
            int64_t at = pos, stop = pos + got;
            for (int k = i; k < upto; k++) {
                if (at + (int64_t)rs->rlen[k] > stop) job->status[k] = 2; /* the file ends inside it */
                else if (job->trusted && job->trusted[k]) job->status[k] = 1;
                else {
                    uint64_t sum = hash_record(rs, h, k);
                    job->status[k] = h->failed ? 3 : sum == job->sums[k] ? 1 : 2;
                    h->failed = 0;
                }
                at += rs->rlen[k];
            }
            if (got < want) {
                for (int k = upto; k < end; k++) job->status[k] = 2;
                return;
            }
        }
        pos += want;
        i = upto;
    }
}

/* -- the library's threads: started on first need, then kept for the process ------------------
 *
 * A batch's helpers and a put's write thread are tasks for these workers: starting a thread per
 * call and joining it cost 15-35 us each way on the dev VM (more right after a batch's IO has
 * gone through the caches), a few percent of a 64 KiB-page batch. A worker is started when a
 * task is queued and no worker is free (up to KVT_WORKERS); workers wait for tasks for good.
 * A task not started yet can be withdrawn (the caller then does its work itself, or none is
 * left). In a forked child the pool starts empty: the parent's workers are not there, and a
 * task from before the fork (its generation) is never waited for. */
#define KVT_WORKERS 64

typedef struct kvt_task {
    void *(*fn)(void *);
    void *arg;
    struct kvt_task *next;
    int state; /* 0 queued, 1 running, 2 ended, 3 withdrawn */
    unsigned gen;
} kvt_task;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER; /* a task queued */
static pthread_cond_t pool_ended = PTHREAD_COND_INITIALIZER; /* a task ended */
static kvt_task *queue_head, *queue_tail;
static int pool_workers, pool_free, pool_queued;
static unsigned pool_gen;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_child(void) {
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c1 = PTHREAD_COND_INITIALIZER, c2 = PTHREAD_COND_INITIALIZER;
    memcpy(&pool_mu, &mu, sizeof mu);
    memcpy(&pool_work, &c1, sizeof c1);
    memcpy(&pool_ended, &c2, sizeof c2);
    queue_head = queue_tail = NULL;
    pool_workers = pool_free = pool_queued = 0;
    pool_gen++;
}

/* Takes pool_mu before a fork and gives it back on both sides, so that the child never
 * inherits it held by a thread it does not have. */
static void pool_prepare(void) { pthread_mutex_lock(&pool_mu); }
static void pool_parent(void) { pthread_mutex_unlock(&pool_mu); }

static void pool_init(void) { pthread_atfork(pool_prepare, pool_parent, pool_child); }

static void *worker(void *unused) {
    (void)unused;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (!queue_head) {
            pool_free++;
            pthread_cond_wait(&pool_work, &pool_mu);
            pool_free--;
        }
        kvt_task *t = queue_head;
        queue_head = t->next;
        if (!queue_head) queue_tail = NULL;
        pool_queued--;
        t->state = 1;
        pthread_mutex_unlock(&pool_mu);
        t->fn(t->arg);
        pthread_mutex_lock(&pool_mu);
        t->state = 2;
        pthread_cond_broadcast(&pool_ended);
    }
    return NULL;
}

/* The workers this process's pool has started (they never end). */
int kvt_workers(void) {
    pthread_mutex_lock(&pool_mu);
    int n = pool_workers;
    pthread_mutex_unlock(&pool_mu);
    return n;
}

/* Queue `t` (its fn and arg set); 0, or -1 if no worker is there to take it and none could be
 * started (nothing queued then). */
static int pool_submit(kvt_task *t) {
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool_mu);
    if (pool_queued + 1 > pool_free && pool_workers < KVT_WORKERS) {
        pthread_t th;
        pthread_attr_t attr;
        int ok = pthread_attr_init(&attr) == 0;
        if (ok) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            ok = pthread_create(&th, &attr, worker, NULL) == 0;
            pthread_attr_destroy(&attr);
        }
        if (ok) pool_workers++;
        else if (!pool_workers) {
            pthread_mutex_unlock(&pool_mu);
            return -1;
        }
    }
    t->next = NULL;
    t->state = 0;
    t->gen = pool_gen;
    if (queue_tail) queue_tail->next = t;
    else queue_head = t;
    queue_tail = t;
    pool_queued++;
    pthread_cond_signal(&pool_work);
    pthread_mutex_unlock(&pool_mu);
    return 0;
}

/* Wait for `t` to end; with `withdraw`, a task not started yet is taken off the queue instead
 * (state 3). Its final state (a task from before a fork: 3). */
static int pool_finish(kvt_task *t, int withdraw) {
    pthread_mutex_lock(&pool_mu);
    if (t->gen != pool_gen) {
        pthread_mutex_unlock(&pool_mu);
        return 3;
    }
    if (withdraw && t->state == 0) {
        kvt_task **at = &queue_head, *prev = NULL;
        while (*at != t) {
            prev = *at;
            at = &(*at)->next;
        }
        *at = t->next;
        if (queue_tail == t) queue_tail = prev;
        pool_queued--;
        t->state = 3;
    }
    while (t->state < 2) pthread_cond_wait(&pool_ended, &pool_mu);
    int state = t->state;
    pthread_mutex_unlock(&pool_mu);
    return state;
}

static void *drain(void *arg) {
    kvt_job *job = arg;
    kvt_hasher h = {job->hash, job->stream, NULL, 0};
    for (;;) {
        int j = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (j >= job->nruns) break;
        one_run(job, &h, &job->runs[j]);
    }
    hasher_done(&h);
    return NULL;
}

/* Every run once, on this thread and up to threads-1 helpers (the library's workers); 0, or -1
 * if no helper could be had (the runs still all ran, on this thread). */
static int run_all(kvt_job *job, int threads) {
    kvt_task helpers[KVT_THREADS];
    int started = 0, ret = 0;
    if (threads > KVT_THREADS) threads = KVT_THREADS;
    if (threads > job->nruns) threads = job->nruns;
    for (int t = 1; t < threads; t++) {
        helpers[started].fn = drain;
        helpers[started].arg = job;
        if (pool_submit(&helpers[started]) != 0) {
            ret = -1;
            break;
        }
        started++;
    }
    drain(job);
    for (int t = 0; t < started; t++) pool_finish(&helpers[t], 1); /* none left for a late one */
    return ret;
}

/* Records of several parts are hashed by the streaming calls: refused (-3) without them. */
static int parts_unhashable(const int64_t *pstart, const kvt_stream *stream) {
    return pstart && !stream;
}

/* Read records i = 0..n-1 (sorted by file and offset: fd[i], off[i]; rlen[i] bytes each, into
 * their parts: pstart, paddr, plen as at the top of this file) and check each against sums[i]:
 * status[i] = 1 served, 2 failed verification or cut short by the file's end, 3 its read failed
 * (*err: the first errno), 0 not read (fd[i] < 0); records a run's earlier syscalls moved keep
 * their verdicts. trusted (or NULL): records served read in full without a check (the store's
 * verify="once" rule). Runs are cut here: records back to back in one file, a new run where the
 * bytes before a record (from its file run's start) cross a multiple of run_bytes, and around a
 * record larger than run_bytes. 0, -1 (no helper thread: all read on this one), -2 (no memory),
 * -3 (parts without a stream to hash them: nothing read). */
int kvt_read_records(const int32_t *fd, const int64_t *off, const uint64_t *rlen,
                     const int64_t *pstart, const uint64_t *paddr, const uint64_t *plen,
                     const uint64_t *sums, uint8_t *status, int n, int64_t run_bytes, int threads,
                     const uint8_t *trusted, kvt_hash hash, const kvt_stream *stream,
                     int32_t *err) {
    *err = 0;
    if (parts_unhashable(pstart, stream)) return -3;
    kvt_run *runs = malloc(sizeof(kvt_run) * (n ? n : 1));
    if (!runs) return -2;
    int nruns = 0;
    int64_t since = 0; /* bytes before record i in its file run */
    for (int i = 0; i < n; i++) {
        int same = i && fd[i] == fd[i - 1] && off[i] == off[i - 1] + (int64_t)rlen[i - 1];
        since = same ? since + (int64_t)rlen[i - 1] : 0;
        int cut = !same || (int64_t)rlen[i] > run_bytes || (int64_t)rlen[i - 1] > run_bytes ||
                  (since - (int64_t)rlen[i - 1]) / run_bytes != since / run_bytes;
        if (fd[i] < 0) continue; /* its segment could not be opened: not read */
        if (cut || !nruns) {
            kvt_run r = {off[i], fd[i], i, 1, 0};
            runs[nruns++] = r;
        } else {
            runs[nruns - 1].count++;
        }
    }
    kvt_recs recs = {rlen, pstart, paddr, plen};
    kvt_job job = {0, runs, nruns, recs, (uint64_t *)sums, status, hash, 0, run_bytes, stream,
                   trusted, 0, 0};
    int ret = run_all(&job, threads);
    for (int r = 0; r < nruns && !*err; r++) *err = runs[r].err;
    free(runs);
    return ret;
}

static void *hash_all(void *arg) {
    kvt_job *job = arg;
    kvt_hasher h = {job->hash, job->stream, NULL, 0};
    for (int r = 0; r < job->nruns; r++)
        for (int k = job->runs[r].first; k < job->runs[r].first + job->runs[r].count; k++)
            job->sums[k] = hash_record(&job->recs, &h, k);
    if (h.failed) __atomic_store_n(&job->unhashed, 1, __ATOMIC_RELAXED);
    hasher_done(&h);
    return NULL;
}

/* Hash each record into sums and write the runs (records as at the top of this file). With
 * threads >= 2, a helper hashes every record while this thread writes every run, in order: one
 * writer per file, the hashing beside it. Measured against the other arrangements on the H100
 * host (64 KiB pages; 2 CPUs / all 16 / two processes on one root and 2 CPUs, % of raw;
 * bench_storage.md run M): this one 73 / 95 / 71; two threads each hashing and writing whole
 * runs 86-98 / 79-80 / 47-54 (buffered writes to one file take its inode lock in turns and a
 * waiting writer spins on it: CPU a second process needed); the same with the writes on a mutex
 * 75 / 82 / 59; one thread 72 / 60 / 70. On one thread, a record larger than `piece` (> 0)
 * that is a run of its own is hashed and written in pieces (write_in_pieces), and with `after`
 * each run (piece) is hashed right after its write, from the cache the write's copy left it in,
 * instead of just before (64 KiB records on the H100 host, 2 CPUs: CPU 0.40 against 0.43 s/GB,
 * 62% against 57% of raw; two processes 60% against 55%: its XXH3 reads memory at 7.9 GB/s and
 * the cache at 17.9). 0; -2 if a record could not be hashed (no memory for a hash state: its
 * checksum is void, the runs written); -3 (parts without a stream: nothing written). */
int kvt_write(kvt_run *runs, int nruns, const uint64_t *rlen, const int64_t *pstart,
              const uint64_t *paddr, const uint64_t *plen, uint64_t *sums, int threads,
              int64_t piece, int after, kvt_hash hash, const kvt_stream *stream) {
    if (parts_unhashable(pstart, stream)) return -3;
    kvt_recs recs = {rlen, pstart, paddr, plen};
    kvt_job job = {1, runs, nruns, recs, sums, NULL, hash, 0, piece, stream, NULL, 0, after, 0};
    kvt_task helper = {hash_all, &job, NULL, 0, 0};
    if (threads >= 2 && nruns && pool_submit(&helper) == 0) {
        job.hashed = 1;
        drain(&job);
        if (pool_finish(&helper, 1) == 3) hash_all(&job); /* not started: hashed here */
    } else {
        run_all(&job, 1);
    }
    return job.unhashed ? -2 : 0;
}

/* A write in flight: a worker writes every run, in order (one writer a file), while the caller
 * hashes the records (kvt_hash_records) and prepares their journal entries and index records;
 * kvt_write_wait ends it. The caller keeps runs and every record's buffer alive until then.
 * Against kvt_write's arrangement (a helper hashes while the caller writes, the Python work
 * after it), paired batch by batch on the H100 host, 64 KiB records: batches ~10% shorter on 2
 * CPUs (eight rounds, 5-26% each), ~6% on 16 (four rounds); alike on the dev VM, whose XXH3 is
 * 3-4 times faster (bench_storage.md run N, call 6). The store's default.
 *
 * The journal: the caller hands its entries over while the runs are written (kvt_write_journal),
 * and the worker writes them right after the runs if every run succeeded (then, where asked,
 * fdatasync-s the segment and the journal, then stamps the segment's mtime), in the order the
 * caller would: after the bytes they describe. The worker never waits for them: entries not
 * there when the runs end, or a run that failed, leave the journal to the caller (its entries
 * cut to the records before the failed run). So a worker is free once its runs are written,
 * whatever the caller does (a write never ended, held by a traceback, holds no worker). */
typedef struct {
    kvt_job job;
    kvt_task task;
    int given;        /* under pool_mu: 0 not yet, 1 given (taken by the worker once its runs
                         succeed), 3 too late (the worker ended without them) */
    int jfd, dfd, sync;
    int64_t joff, jlen, time_ns;
    uint8_t *jbuf;    /* a copy of the entries */
    int32_t jdone;    /* out: the journal written (synced where asked) and the mtime set */
    int32_t jerr;     /* out: the errno of the journal's write, sync or mtime (jdone 0) */
} kvt_pending;

static void *write_runs(void *arg) {
    kvt_pending *p = arg;
    kvt_job *job = &p->job;
    int failed = 0;
    for (int r = 0; r < job->nruns; r++) {
        one_run(job, NULL, &job->runs[r]); /* hashed by the caller: no hasher */
        failed |= job->runs[r].err != 0;
    }
    pthread_mutex_lock(&pool_mu);
    int given = p->given;
    if (given != 1) p->given = 3; /* any entries handed over from now on are the caller's */
    pthread_mutex_unlock(&pool_mu);
    if (failed || given != 1) return NULL;
    int64_t done = 0;
    while (done < p->jlen) {
        ssize_t got = pwrite(p->jfd, p->jbuf + done, (size_t)(p->jlen - done), p->joff + done);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            p->jerr = got < 0 ? errno : EIO;
            return NULL;
        }
        done += got;
    }
    if (p->sync && (fdatasync(p->dfd) != 0 || fdatasync(p->jfd) != 0)) {
        p->jerr = errno;
        return NULL;
    }
    struct timespec ts[2];
    ts[0].tv_sec = ts[1].tv_sec = p->time_ns / 1000000000;
    ts[0].tv_nsec = ts[1].tv_nsec = p->time_ns % 1000000000;
    if (futimens(p->dfd, ts) != 0) {
        p->jerr = errno;
        return NULL;
    }
    p->jdone = 1;
    return NULL;
}

/* A write of the runs, not started yet (kvt_write_submit starts it), or NULL (no memory).
 * Records as at the top of this file; nothing is hashed here. */
void *kvt_write_prepare(kvt_run *runs, int nruns, const uint64_t *rlen, const int64_t *pstart,
                        const uint64_t *paddr, const uint64_t *plen) {
    kvt_pending *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    kvt_recs recs = {rlen, pstart, paddr, plen};
    kvt_job job = {1, runs, nruns, recs, NULL, NULL, NULL, 0, 0, NULL, NULL, 1, 0};
    p->job = job;
    p->task.fn = write_runs;
    p->task.arg = p;
    return p;
}

/* Start a prepared write on a worker (a handle for kvt_write_journal and kvt_write_wait); 0, or
 * -1 if no worker could take it (nothing written; the handle is freed). */
int kvt_write_submit(void *handle) {
    kvt_pending *p = handle;
    if (pool_submit(&p->task) != 0) {
        free(p->jbuf);
        free(p);
        return -1;
    }
    return 0;
}

/* The write started (kvt_write_prepare, then kvt_write_submit), or NULL if no worker could take
 * it (nothing written then). */
void *kvt_write_start(kvt_run *runs, int nruns, const uint64_t *rlen, const int64_t *pstart,
                      const uint64_t *paddr, const uint64_t *plen) {
    void *p = kvt_write_prepare(runs, nruns, rlen, pstart, paddr, plen);
    return p && kvt_write_submit(p) == 0 ? p : NULL;
}

/* Hand over the journal entries (`len` bytes, copied) for the worker to write at `offset` of
 * `jfd` after the runs, then with `sync` fdatasync `dfd` (the segment) and `jfd`, then set
 * `dfd`'s times to time_ns; 0 (handed over: the worker writes them if its runs succeed), 1 (too
 * late: the worker has ended) or -1 (no memory for the copy); on 1 and -1 the caller writes
 * them. Once per write, before kvt_write_wait. */
int kvt_write_journal(void *handle, int jfd, int64_t offset, const uint8_t *entries, int64_t len,
                      int sync, int dfd, int64_t time_ns) {
    kvt_pending *p = handle;
    uint8_t *copy = malloc(len ? (size_t)len : 1);
    if (!copy) return -1;
    memcpy(copy, entries, (size_t)len);
    pthread_mutex_lock(&pool_mu);
    int late = p->given == 3;
    if (!late) {
        p->jbuf = copy;
        p->jfd = jfd;
        p->joff = offset;
        p->jlen = len;
        p->sync = sync;
        p->dfd = dfd;
        p->time_ns = time_ns;
        p->given = 1;
    }
    pthread_mutex_unlock(&pool_mu);
    if (late) free(copy);
    return late;
}

/* Whether the worker has ended (its runs written, and its journal step if it took one). */
int kvt_write_ended(void *handle) {
    kvt_pending *p = handle;
    pthread_mutex_lock(&pool_mu);
    int ended = p->task.gen != pool_gen || p->task.state >= 2;
    pthread_mutex_unlock(&pool_mu);
    return ended;
}

/* Wait for a started write to end (each run's err set) and free its handle; out (or NULL):
 * jdone, jerr (kvt_pending's). */
void kvt_write_wait(void *handle, int32_t *out) {
    kvt_pending *p = handle;
    pool_finish(&p->task, 0);
    if (out) {
        out[0] = p->jdone;
        out[1] = p->jerr;
    }
    free(p->jbuf);
    free(p);
}

/* Each record's checksum into sums (records as at the top of this file), on the calling
 * thread; 0, -2 (a record could not be hashed: no memory for a hash state), or -3 (parts
 * without a stream: nothing hashed). */
int kvt_hash_records(const uint64_t *rlen, const int64_t *pstart, const uint64_t *paddr,
                     const uint64_t *plen, int n, uint64_t *sums, kvt_hash hash,
                     const kvt_stream *stream) {
    if (parts_unhashable(pstart, stream)) return -3;
    kvt_recs recs = {rlen, pstart, paddr, plen};
    kvt_hasher h = {hash, stream, NULL, 0};
    for (int i = 0; i < n; i++) sums[i] = hash_record(&recs, &h, i);
    hasher_done(&h);
    return h.failed ? -2 : 0;
}

/* -- journal entries (format.py's layout), CRC-32 as zlib computes it -------------------------- */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int t = 1; t < 8; t++)
            crc_table[t][b] = (crc_table[t - 1][b] >> 8) ^ crc_table[0][crc_table[t - 1][b] & 0xFF];
}

uint32_t kvt_crc32(const uint8_t *p, size_t n, uint32_t crc) {
    pthread_once(&crc_once, crc_init);
    crc = ~crc;
    while (n >= 8) { /* slicing by 8 (little-endian hosts) */
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_table[7][v & 0xFF] ^ crc_table[6][(v >> 8) & 0xFF] ^
              crc_table[5][(v >> 16) & 0xFF] ^ crc_table[4][(v >> 24) & 0xFF] ^
              crc_table[3][(v >> 32) & 0xFF] ^ crc_table[2][(v >> 40) & 0xFF] ^
              crc_table[1][(v >> 48) & 0xFF] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#define ENTRY_HEAD 40 /* magic, key length, flags, algorithm, offset, length, checksum, time */

static void put16(uint8_t *p, uint16_t v) { p[0] = v; p[1] = v >> 8; }
static void put32(uint8_t *p, uint32_t v) { for (int k = 0; k < 4; k++) p[k] = v >> (8 * k); }
static void put64(uint8_t *p, uint64_t v) { for (int k = 0; k < 8; k++) p[k] = v >> (8 * k); }

/* Record entries of n keys (`keys`: the keys' ASCII bytes back to back, key i from kstart[i] to
 * kstart[i+1]) into `out`, which holds sum(44 + key length) bytes; the bytes written. */
int64_t kvt_encode_entries(const uint8_t *keys, const int64_t *kstart, int n,
                           const uint64_t *offsets, const uint64_t *lengths, uint64_t time_ns,
                           const uint8_t *algorithms, const uint64_t *sums, uint8_t *out) {
    uint8_t *p = out;
    for (int i = 0; i < n; i++) {
        int64_t k = kstart[i + 1] - kstart[i];
        memcpy(p, "KVS2", 4);
        put16(p + 4, (uint16_t)k);
        p[6] = 0;
        p[7] = algorithms[i];
        put64(p + 8, offsets[i]);
        put64(p + 16, lengths[i]);
        put64(p + 24, sums[i]);
        put64(p + 32, time_ns);
        uint32_t crc = kvt_crc32(p, ENTRY_HEAD, 0);
        crc = kvt_crc32(keys + kstart[i], (size_t)k, crc);
        put32(p + ENTRY_HEAD, crc);
        memcpy(p + ENTRY_HEAD + 4, keys + kstart[i], (size_t)k);
        p += ENTRY_HEAD + 4 + k;
    }
    return p - out;
}
