/* Captured steps' OpenMP regions on a team of spinning threads, without syscalls.
 *
 * GCC lowers `#pragma omp parallel` to GOMP_parallel(fn, data, n, flags) and a work-shared
 * loop to GOMP_loop_* calls. libgomp's fork and join cost ~1.2-1.6 us a region on the 2-core
 * VMs of this project, with two futex syscalls each (its barriers wake waiters whether or not
 * any sleep), and a replayed batch-1 decode step opens ~90 regions. The kernels are linked with
 * `--wrap=NAME` for each entry point they use (`native.TEAM_LINKS`), so their calls come here
 * (this library is loaded with RTLD_GLOBAL before them):
 *
 *   - between team_begin() and team_end() (a `CallRun`: a captured step's native calls, no
 *     torch op among them), a region runs on this team: a fork is a word the workers spin on,
 *     a join a count the caller spins on (~0.45 us a region);
 *   - elsewhere (eager steps, whose torch ops run on torch's libgomp) it is libgomp's region,
 *     as without this library: two spinning teams would take turns on the same cores (a
 *     prefill ran at 0.7x). For the same reason a run stays on libgomp within libgomp_spin_ns
 *     of a region that went there outside a run: libgomp's workers spin that long after one
 *     (~9 ms here at GOMP_SPINCOUNT's default 300,000 pauses; oxserve sets 20,000 where it
 *     can, see oxserve/__init__.py), so runs between eager steps are as they were. (The regions of a run that stays on libgomp do not count: else runs would keep
 *     each other there. The first run on the team after them shares the cores for ~9 ms.)
 *
 * After team_end() the workers spin LINGER_NS for the next step's run, then sleep on a futex
 * (team_begin() wakes them, a syscall only then); a kernel region outside a run sends them to
 * sleep at once (an eager step is running: libgomp's threads need the cores).
 *
 * Semantics kept on the team: exactly the threads asked for (a false `if` clause arrives as
 * 1); omp_get_thread_num / omp_get_num_threads; barriers; static loops (GCC inlines them);
 * dynamic and runtime-scheduled loops (omp_set_schedule: static or dynamic, any chunk, dealt
 * as libgomp deals them). A region opened inside a region, or while another thread's region
 * runs, runs on its calling thread alone, as libgomp runs a nested region. A forked child
 * starts new workers. */
#define _GNU_SOURCE
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_TEAM 64
#define MAX_LOOPS 64                    /* dynamic loops a region (the routed W8A8 experts have 4) */
#define LINGER_NS 2000000u              /* how long workers spin after a run for the next one */
static uint64_t libgomp_spin_ns = 15000000u; /* how long libgomp's workers may spin after a region */
#define EXPORT __attribute__((visibility("default")))
#define WRAP(name) __wrap_##name /* what `ld --wrap=name` binds the kernels' calls of name to */
#define SIZE_BITS 8                     /* `start`: a region's number << SIZE_BITS | its size */

typedef void (*region_fn)(void *);

/* libgomp's entry points, for regions outside a run (this library is not linked with --wrap) */
int omp_get_max_threads(void);
int omp_get_thread_num(void);
int omp_get_num_threads(void);
void omp_set_schedule(int kind, int chunk);
void GOMP_parallel(region_fn fn, void *data, unsigned num_threads, unsigned flags);
void GOMP_barrier(void);
bool GOMP_loop_nonmonotonic_dynamic_start(long, long, long, long, long *, long *);
bool GOMP_loop_nonmonotonic_dynamic_next(long *, long *);
bool GOMP_loop_dynamic_start(long, long, long, long, long *, long *);
bool GOMP_loop_dynamic_next(long *, long *);
bool GOMP_loop_maybe_nonmonotonic_runtime_start(long, long, long, long *, long *);
bool GOMP_loop_maybe_nonmonotonic_runtime_next(long *, long *);
bool GOMP_loop_runtime_start(long, long, long, long *, long *);
bool GOMP_loop_runtime_next(long *, long *);
void GOMP_loop_end(void);
void GOMP_loop_end_nowait(void);

static struct {
    _Alignas(64) atomic_uint start;   /* changed to start a region: its number and size */
    _Alignas(64) atomic_int finished; /* workers done with the current region */
    _Alignas(64) atomic_int owner;    /* 1 while a region runs (one at a time) */
    _Alignas(64) atomic_int runs;     /* team_begin() - team_end(): regions run here while > 0 */
    atomic_int dismissed;             /* a region ran on libgomp since the last run: sleep now */
    _Atomic uint64_t ended_ns;        /* when the last run ended */
    _Atomic uint64_t libgomp_ns;      /* when the last region on libgomp outside a run ended */
    _Alignas(64) atomic_int barrier_count;
    _Alignas(64) atomic_int barrier_sense;
    atomic_int loops_set_up; /* the region's dynamic loops set up so far (slots 0 .. it - 1) */
    region_fn fn;
    void *data;
    int workers;                 /* worker threads started: ids 1 .. workers */
    int sched_kind, sched_chunk; /* the region's runtime schedule: its caller's */
} team;

static struct sleeper {
    _Alignas(64) atomic_uint bell; /* the futex word a sleeping worker waits on */
    atomic_int asleep;
    unsigned first_seen; /* `start` when the worker was made */
} sleepers[MAX_TEAM];

/* A dynamic loop of the current region, set up by the first thread that meets it; the slots a
 * region set up are cleared when it ends (`clear_loops`). */
static struct loop {
    _Alignas(64) atomic_int state; /* 0: not set up, 1: being set up, 2: ready */
    atomic_long next;
    long end, incr, chunk;
} loops[MAX_LOOPS];

/* This thread's place in its region: its id and team size (0 and 1 outside one), the barrier
 * sense it waits for, the dynamic loops it has met, the region's runtime schedule, and its
 * static loop's next chunk. */
struct place {
    int id, size, sense, loops;
    int sched_kind, sched_chunk;
    bool loop_static;
    long next, end, incr, chunk;
};
static __thread struct place my = {.size = 1};
static __thread bool my_libgomp; /* in a region that libgomp runs */
static __thread bool my_in_run, my_run_on_team; /* between team_begin and team_end; on the team */
/* This thread's runtime schedule (omp_set_schedule's; libgomp's default: dynamic, 1). */
static __thread int my_sched_kind = 2, my_sched_chunk = 1;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void enter(int id, int size) {
    my.id = id;
    my.size = size;
    my.loops = 0;
    my.sense = atomic_load_explicit(&team.barrier_sense, memory_order_acquire);
    my.sched_kind = team.sched_kind, my.sched_chunk = team.sched_chunk;
}

/* One wait of a spin: a pause, and every 256th a yield (a thread that waits on one that has
 * no core lets it have this one). */
static inline void relax(unsigned *spins) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
    if (++*spins % 256 == 0) sched_yield();
}

/* Between runs, once they lingered long enough or a region went to libgomp. */
static bool idle(void) {
    return atomic_load(&team.runs) == 0 &&
           (atomic_load(&team.dismissed) || now_ns() - atomic_load(&team.ended_ns) > LINGER_NS);
}

/* Sleep until rung (team_begin, or a region that needs this worker) or a spurious wake-up. */
static void doze(struct sleeper *self, unsigned seen) {
    atomic_store(&self->asleep, 1); /* (seq_cst: before the reads below, as the waker's writes
                                       of `runs` and `start` are before its read of `asleep`) */
    const unsigned bell = atomic_load(&self->bell);
    if (atomic_load(&team.start) == seen && idle())
        syscall(SYS_futex, &self->bell, FUTEX_WAIT_PRIVATE, bell, NULL, NULL, 0);
    atomic_store(&self->asleep, 0);
}

static void ring(int id) {
    if (atomic_load(&sleepers[id].asleep)) {
        atomic_fetch_add(&sleepers[id].bell, 1);
        syscall(SYS_futex, &sleepers[id].bell, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    struct sleeper *self = &sleepers[id];
    unsigned seen = self->first_seen, spins = 0;
    for (;;) {
        const unsigned word = atomic_load_explicit(&team.start, memory_order_acquire);
        if (word == seen) {
            relax(&spins);
            if (spins % 1024 == 0 && idle()) doze(self, seen);
            continue;
        }
        seen = word;
        const int size = (int)(word & ((1u << SIZE_BITS) - 1));
        if (id >= size) continue; /* not in this region: nothing of it is read */
        enter(id, size);
        team.fn(team.data);
        my.size = 1;
        atomic_fetch_add_explicit(&team.finished, 1, memory_order_release);
    }
    return NULL;
}

/* Only the slots the region used: each is a cache line the kernels' data has since evicted. */
static void clear_loops(void) {
    const int used = atomic_load_explicit(&team.loops_set_up, memory_order_relaxed);
    for (int i = 0; i < used; i++) atomic_store_explicit(&loops[i].state, 0, memory_order_relaxed);
    atomic_store_explicit(&team.loops_set_up, 0, memory_order_relaxed);
}

/* The child of a fork has none of the parent's workers, and no run or region going on (a
 * thread of the parent's may have been in one). */
static void forked_child(void) {
    team.workers = 0;
    atomic_store(&team.owner, 0);
    atomic_store(&team.runs, 0);
    atomic_store(&team.finished, 0);
    atomic_store(&team.barrier_count, 0);
    clear_loops();
    atomic_store(&team.dismissed, 1);
    for (int id = 0; id < MAX_TEAM; id++) atomic_store(&sleepers[id].asleep, 0);
    my_in_run = my_run_on_team = false;
}

/* Workers 1 .. size - 1 running (the caller holds the team); false if one cannot start. */
static bool grown(int size) {
    static bool forks_handled;
    if (!forks_handled) forks_handled = pthread_atfork(NULL, NULL, forked_child) == 0;
    while (team.workers < size - 1) {
        const int id = team.workers + 1;
        atomic_store(&sleepers[id].asleep, 0);
        sleepers[id].first_seen = atomic_load(&team.start); /* (pthread_create orders it before the thread) */
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (failed) return false;
        team.workers = id;
    }
    return true;
}

/* A run of calls begins (`call_list.c`; team_end ends it): their regions run on the team
 * (1), or on libgomp where its workers may still spin (0). */
EXPORT int team_begin(void) {
    my_in_run = true;
    my_run_on_team = now_ns() - atomic_load_explicit(&team.libgomp_ns, memory_order_relaxed) >= libgomp_spin_ns;
    if (!my_run_on_team) return 0;
    atomic_store(&team.dismissed, 0);
    atomic_fetch_add(&team.runs, 1); /* (seq_cst: before the reads of `asleep`, see doze) */
    for (int id = 1; id <= team.workers; id++) ring(id);
    return 1;
}

/* How long libgomp's workers spin after a region (`native.team` reads its settings). */
EXPORT void team_set_libgomp_spin(uint64_t ns) { libgomp_spin_ns = ns; }

EXPORT void team_end(void) {
    my_in_run = false;
    if (!my_run_on_team) return;
    my_run_on_team = false;
    atomic_store(&team.ended_ns, now_ns());
    atomic_fetch_sub(&team.runs, 1);
}

struct forwarded {
    region_fn fn;
    void *data;
};

/* A region on libgomp: its threads say so to the entry points below. */
static void on_libgomp(void *arg) {
    const struct forwarded *region = arg;
    const bool was = my_libgomp;
    my_libgomp = true;
    region->fn(region->data);
    my_libgomp = was;
}

/* fn on the calling thread alone (its place in an enclosing region kept). */
static void alone(region_fn fn, void *data) {
    const struct place outer = my;
    my = (struct place){.size = 1, .sched_kind = my_sched_kind, .sched_chunk = my_sched_chunk};
    fn(data);
    my = outer;
}

EXPORT void WRAP(GOMP_parallel)(region_fn fn, void *data, unsigned num_threads, unsigned flags) {
    if (my_libgomp || atomic_load_explicit(&team.runs, memory_order_relaxed) == 0) {
        const bool in_run = my_in_run;
        if (!atomic_load_explicit(&team.dismissed, memory_order_relaxed)) atomic_store(&team.dismissed, 1);
        struct forwarded region = {fn, data};
        GOMP_parallel(on_libgomp, &region, num_threads, flags);
        if (num_threads != 1 && !in_run) atomic_store_explicit(&team.libgomp_ns, now_ns(), memory_order_relaxed);
        return;
    }
    (void)flags; /* (proc_bind: the OS places the threads) */
    const int asked = num_threads ? (int)num_threads : omp_get_max_threads(); /* (0: no num_threads clause) */
    const int size = asked > MAX_TEAM ? MAX_TEAM : asked;
    int unowned = 0;
    if (size <= 1 || my.size > 1 || my.id != 0 || !atomic_compare_exchange_strong(&team.owner, &unowned, 1)) {
        alone(fn, data); /* one thread, a nested region, or another thread's region is running */
        return;
    }
    if (!grown(size)) {
        atomic_store(&team.owner, 0);
        alone(fn, data);
        return;
    }
    team.fn = fn, team.data = data;
    team.sched_kind = my_sched_kind, team.sched_chunk = my_sched_chunk;
    atomic_store_explicit(&team.finished, 0, memory_order_relaxed);
    const unsigned number = atomic_load_explicit(&team.start, memory_order_relaxed) >> SIZE_BITS;
    atomic_store(&team.start, (number + 1) << SIZE_BITS | (unsigned)size); /* (seq_cst: see doze) */
    for (int id = 1; id < size; id++) ring(id);
    enter(0, size);
    fn(data);
    unsigned spins = 0;
    while (atomic_load_explicit(&team.finished, memory_order_acquire) < size - 1) relax(&spins);
    clear_loops(); /* (every thread is past them: their set-ups happened before their `finished`) */
    my.size = 1;
    atomic_store_explicit(&team.owner, 0, memory_order_release);
}

EXPORT int WRAP(omp_get_thread_num)(void) { return my_libgomp ? omp_get_thread_num() : my.id; }

EXPORT int WRAP(omp_get_num_threads)(void) { return my_libgomp ? omp_get_num_threads() : my.size; }

/* Sense-reversing: the last thread in resets the count and flips the sense the others wait on. */
EXPORT void WRAP(GOMP_barrier)(void) {
    if (my_libgomp) {
        GOMP_barrier();
        return;
    }
    if (my.size == 1) return;
    const int sense = !my.sense;
    my.sense = sense;
    if (atomic_fetch_add_explicit(&team.barrier_count, 1, memory_order_acq_rel) == my.size - 1) {
        atomic_store_explicit(&team.barrier_count, 0, memory_order_relaxed);
        atomic_store_explicit(&team.barrier_sense, sense, memory_order_release);
    } else {
        unsigned spins = 0;
        while (atomic_load_explicit(&team.barrier_sense, memory_order_acquire) != sense) relax(&spins);
    }
}

/* ---- work-shared loops: [start, end) by incr, each call handing out [*istart, *iend) ------ */

static bool past(long i, long end, long incr) { return incr > 0 ? i >= end : i <= end; }

static bool handed(long i, long end, long incr, long chunk, long *istart, long *iend) {
    if (past(i, end, incr)) return false;
    const long stop = i + chunk * incr;
    *istart = i;
    *iend = past(stop, end, incr) ? end : stop;
    return true;
}

static bool dynamic_next(long *istart, long *iend) {
    struct loop *loop = &loops[my.loops - 1];
    const long i = atomic_fetch_add_explicit(&loop->next, loop->chunk * loop->incr, memory_order_relaxed);
    return handed(i, loop->end, loop->incr, loop->chunk, istart, iend);
}

static bool dynamic_start(long start, long end, long incr, long chunk, long *istart, long *iend) {
    if (my.loops == MAX_LOOPS) {
        fprintf(stderr, "oxserve team.c: more than %d dynamic loops in one region\n", MAX_LOOPS);
        abort(); /* (a kernel's design error: every thread of the region would need the same answer) */
    }
    struct loop *loop = &loops[my.loops++];
    int fresh = 0;
    if (atomic_compare_exchange_strong(&loop->state, &fresh, 1)) {
        loop->end = end, loop->incr = incr, loop->chunk = chunk > 0 ? chunk : 1;
        atomic_store_explicit(&loop->next, start, memory_order_relaxed);
        atomic_store_explicit(&loop->state, 2, memory_order_release);
        /* (slot k is set up after slot k - 1 was, by whichever thread: the count only grows) */
        atomic_store_explicit(&team.loops_set_up, my.loops, memory_order_relaxed);
    } else {
        unsigned spins = 0;
        while (atomic_load_explicit(&loop->state, memory_order_acquire) != 2) relax(&spins);
    }
    return dynamic_next(istart, iend);
}

/* Chunks dealt round robin from the thread's id; without a chunk, one block a thread, the
 * first count % size blocks one longer (libgomp's static schedule). */
static bool static_next(long *istart, long *iend) {
    const long i = my.next;
    my.next += my.size * my.chunk * my.incr;
    return handed(i, my.end, my.incr, my.chunk, istart, iend);
}

static bool static_start(long start, long end, long incr, long chunk, long *istart, long *iend) {
    if (chunk > 0) {
        my.next = start + my.id * chunk * incr, my.end = end, my.incr = incr, my.chunk = chunk;
        return static_next(istart, iend);
    }
    const long count = past(start, end, incr) ? 0 : (end - start + incr - (incr > 0 ? 1 : -1)) / incr;
    const long base = count / my.size, extra = count % my.size;
    const long length = base + (my.id < extra);
    if (length == 0) return false;
    my.next = start + (my.id * base + (my.id < extra ? my.id : extra)) * incr;
    my.end = my.next + length * incr, my.incr = incr, my.chunk = length;
    return static_next(istart, iend);
}

/* A loop's first chunk: dynamic, or static (a runtime schedule's static, or a team of one). */
static bool loop_start(long start, long end, long incr, long chunk, bool dynamic, long *istart, long *iend) {
    my.loop_static = !dynamic || my.size == 1;
    if (my.size == 1) chunk = 0; /* (a region of one thread: the whole loop, no shared slot) */
    return my.loop_static ? static_start(start, end, incr, chunk, istart, iend)
                          : dynamic_start(start, end, incr, chunk, istart, iend);
}

static bool loop_next(long *istart, long *iend) {
    return my.loop_static ? static_next(istart, iend) : dynamic_next(istart, iend);
}

/* Each loop entry point: libgomp's in its regions, this team's in its own. */
EXPORT bool WRAP(GOMP_loop_nonmonotonic_dynamic_start)(long start, long end, long incr, long chunk, long *istart,
                                                       long *iend) {
    if (my_libgomp) return GOMP_loop_nonmonotonic_dynamic_start(start, end, incr, chunk, istart, iend);
    return loop_start(start, end, incr, chunk, true, istart, iend);
}

EXPORT bool WRAP(GOMP_loop_nonmonotonic_dynamic_next)(long *istart, long *iend) {
    return my_libgomp ? GOMP_loop_nonmonotonic_dynamic_next(istart, iend) : loop_next(istart, iend);
}

EXPORT bool WRAP(GOMP_loop_dynamic_start)(long start, long end, long incr, long chunk, long *istart, long *iend) {
    if (my_libgomp) return GOMP_loop_dynamic_start(start, end, incr, chunk, istart, iend);
    return loop_start(start, end, incr, chunk, true, istart, iend);
}

EXPORT bool WRAP(GOMP_loop_dynamic_next)(long *istart, long *iend) {
    return my_libgomp ? GOMP_loop_dynamic_next(istart, iend) : loop_next(istart, iend);
}

EXPORT bool WRAP(GOMP_loop_maybe_nonmonotonic_runtime_start)(long start, long end, long incr, long *istart, long *iend) {
    if (my_libgomp) return GOMP_loop_maybe_nonmonotonic_runtime_start(start, end, incr, istart, iend);
    return loop_start(start, end, incr, my.sched_chunk, my.sched_kind != 1, istart, iend);
}

EXPORT bool WRAP(GOMP_loop_maybe_nonmonotonic_runtime_next)(long *istart, long *iend) {
    return my_libgomp ? GOMP_loop_maybe_nonmonotonic_runtime_next(istart, iend) : loop_next(istart, iend);
}

EXPORT bool WRAP(GOMP_loop_runtime_start)(long start, long end, long incr, long *istart, long *iend) {
    if (my_libgomp) return GOMP_loop_runtime_start(start, end, incr, istart, iend);
    return loop_start(start, end, incr, my.sched_chunk, my.sched_kind != 1, istart, iend);
}

EXPORT bool WRAP(GOMP_loop_runtime_next)(long *istart, long *iend) {
    return my_libgomp ? GOMP_loop_runtime_next(istart, iend) : loop_next(istart, iend);
}

EXPORT void WRAP(GOMP_loop_end)(void) {
    if (my_libgomp) GOMP_loop_end();
    else WRAP(GOMP_barrier)();
}

EXPORT void WRAP(GOMP_loop_end_nowait)(void) {
    if (my_libgomp) GOMP_loop_end_nowait();
}

/* The calling thread's, for its next region on either (omp_sched_t: 1 static and 4 auto run
 * static, as libgomp runs auto; 2 dynamic and 3 guided run dynamic; the monotonic flag ignored). */
EXPORT void WRAP(omp_set_schedule)(int kind, int chunk) {
    omp_set_schedule(kind, chunk);
    kind &= 0x7fffffff;
    my_sched_kind = kind == 1 || kind == 4 ? 1 : 2;
    my_sched_chunk = chunk;
}

/* Regions this team has run on more than one thread (tests: the kernels' regions ran here). */
EXPORT unsigned team_regions(void) { return atomic_load(&team.start) >> SIZE_BITS; }
