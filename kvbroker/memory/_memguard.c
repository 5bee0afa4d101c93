/* The broker's SIGBUS guard and tmpfs reservation, for kvbroker/memory/mapping.py (which documents the why).

   A transfer engine's own threads (UCX's progress thread, Mooncake's workers) copy bytes into and
   out of the shared-memory segments servers register. When a server shrinks its segment after
   registration, or /dev/shm cannot back a page of it, the kernel answers such a copy with SIGBUS,
   whose default action ends the broker and every engine on it. Python handlers cannot help: they
   run later, on the main thread, and the faulting instruction would fault again.

   The handler here looks up the faulting address among the mappings memory.py watches. Inside one,
   it maps anonymous zero pages over that whole mapping (MAP_FIXED, a raw syscall: not the libc
   symbol that UCX's memory hooks patch), records the fault, and returns: the engine's copy
   completes harmlessly into memory nobody reads, and memory.py fails that segment's transfers.
   Any other SIGBUS goes to the handler that was installed before (a transfer engine's, Python's
   faulthandler) or takes the default action.

   Python API: ensure(), watch(address, length) -> slot, unwatch(slot), fault(slot) -> address or
   None, repaired() -> count, reserve(fd, offset, length). All are called with the GIL held, which
   serialises the writers of the table; the handler only reads it, and claims a slot by CAS. */

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_WATCHED 16384 /* mappings watched at once: one per (engine, segment) */
#define MAX_CHAINED 8     /* times the guard re-installs itself over another library's handler */

enum { FREE, ACTIVE, REPAIRING, POISONED };

struct watched {
    _Atomic int state;
    uintptr_t start, end; /* written only while FREE, published by the store of ACTIVE */
    _Atomic uintptr_t fault;
};

static struct watched table[MAX_WATCHED];
static _Atomic int high_water; /* slots [0, high_water) may be in use */
static _Atomic unsigned long repairs;

/* The handler each installation found; a re-installation appends, so a running handler never
   reads an entry being written. */
static struct sigaction chained[MAX_CHAINED];
static _Atomic int installations;
static __thread int depth __attribute__((tls_model("initial-exec")));

static void guard(int sig, siginfo_t *info, void *context);

static int guard_is_installed(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return 0;
    return (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == guard;
}

static void default_action(int sig, const siginfo_t *info) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    /* A fault recurs when the instruction runs again, now with the default action; a sent signal
       does not, so send it again: it is blocked until this handler returns. */
    if (info == NULL || info->si_code <= 0)
        raise(sig);
}

static void chain(int sig, siginfo_t *info, void *context) {
    int n = atomic_load_explicit(&installations, memory_order_acquire);
    if (n == 0 || depth > 1) { /* a previous handler that chains back to us: stop the loop */
        default_action(sig, info);
        return;
    }
    const struct sigaction *prev = &chained[n - 1];
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction == guard)
            default_action(sig, info);
        else
            prev->sa_sigaction(sig, info, context);
    } else if (prev->sa_handler == SIG_IGN) {
        if (info == NULL || info->si_code > 0) /* the kernel does not let a fault be ignored */
            default_action(sig, info);
    } else if (prev->sa_handler == SIG_DFL) {
        default_action(sig, info);
    } else {
        prev->sa_handler(sig);
    }
}

/* Whether the fault at `addr` was in a watched mapping that is (now) backed by zero pages. */
static int repair(uintptr_t addr) {
    int n = atomic_load_explicit(&high_water, memory_order_acquire);
    for (int i = 0; i < n; i++) {
        struct watched *w = &table[i];
        int state = atomic_load_explicit(&w->state, memory_order_acquire);
        if (state == FREE || addr < w->start || addr >= w->end)
            continue;
        if (state == ACTIVE) {
            int expected = ACTIVE;
            if (atomic_compare_exchange_strong(&w->state, &expected, REPAIRING)) {
                if (addr < w->start || addr >= w->end) { /* the slot was reused since we read it */
                    atomic_store_explicit(&w->state, ACTIVE, memory_order_release);
                    continue;
                }
                long rc = syscall(SYS_mmap, (void *)w->start, (size_t)(w->end - w->start), PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
                if (rc == -1) {
                    atomic_store_explicit(&w->state, ACTIVE, memory_order_release);
                    return 0;
                }
                atomic_store_explicit(&w->fault, addr, memory_order_relaxed);
                atomic_fetch_add_explicit(&repairs, 1, memory_order_relaxed);
                atomic_store_explicit(&w->state, POISONED, memory_order_release);
                return 1;
            }
            state = expected;
        }
        while (state == REPAIRING) { /* another thread faulted in the same mapping and is repairing it */
            syscall(SYS_sched_yield);
            state = atomic_load_explicit(&w->state, memory_order_acquire);
        }
        return state == POISONED;
    }
    return 0;
}

static void guard(int sig, siginfo_t *info, void *context) {
    int saved_errno = errno;
    depth++;
    /* si_code <= 0: sent by kill/raise, whose si_addr means nothing */
    if (!(depth == 1 && info != NULL && info->si_code > 0 && repair((uintptr_t)info->si_addr)))
        chain(sig, info, context);
    depth--;
    errno = saved_errno;
}

static PyObject *ensure(PyObject *self, PyObject *unused) {
    if (guard_is_installed())
        Py_RETURN_FALSE;
    int n = atomic_load_explicit(&installations, memory_order_acquire);
    if (n == MAX_CHAINED) {
        PyErr_Format(PyExc_RuntimeError, "the SIGBUS guard was displaced %d times by other handlers; "
                     "not installing it again", MAX_CHAINED);
        return NULL;
    }
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = guard;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, NULL, &chained[n]) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    atomic_store_explicit(&installations, n + 1, memory_order_release);
    if (sigaction(SIGBUS, &action, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
}

static PyObject *watch(PyObject *self, PyObject *args) {
    unsigned long long address, length;
    if (!PyArg_ParseTuple(args, "KK", &address, &length))
        return NULL;
    if (length == 0 || address + length < address) {
        PyErr_SetString(PyExc_ValueError, "watch: empty or wrapping range");
        return NULL;
    }
    int n = atomic_load_explicit(&high_water, memory_order_relaxed);
    int slot = 0;
    while (slot < n && atomic_load_explicit(&table[slot].state, memory_order_acquire) != FREE)
        slot++;
    if (slot == MAX_WATCHED) {
        PyErr_Format(PyExc_OverflowError, "at most %d shared-memory mappings can be watched at once", MAX_WATCHED);
        return NULL;
    }
    struct watched *w = &table[slot];
    w->start = (uintptr_t)address;
    w->end = (uintptr_t)(address + length);
    atomic_store_explicit(&w->fault, 0, memory_order_relaxed);
    atomic_store_explicit(&w->state, ACTIVE, memory_order_release);
    if (slot == n)
        atomic_store_explicit(&high_water, n + 1, memory_order_release);
    return PyLong_FromLong(slot);
}

static int slot_of(PyObject *args, int *slot) {
    if (!PyArg_ParseTuple(args, "i", slot))
        return 0;
    if (*slot < 0 || *slot >= atomic_load_explicit(&high_water, memory_order_acquire)) {
        PyErr_Format(PyExc_ValueError, "no watched slot %d", *slot);
        return 0;
    }
    return 1;
}

static PyObject *unwatch(PyObject *self, PyObject *args) {
    int slot;
    if (!slot_of(args, &slot))
        return NULL;
    struct watched *w = &table[slot];
    for (;;) { /* a handler repairing this mapping finishes before it may be unmapped */
        int state = atomic_load_explicit(&w->state, memory_order_acquire);
        if (state == FREE)
            break;
        if (state != REPAIRING && atomic_compare_exchange_strong(&w->state, &state, FREE))
            break;
        sched_yield();
    }
    Py_RETURN_NONE;
}

static PyObject *fault(PyObject *self, PyObject *args) {
    int slot;
    if (!slot_of(args, &slot))
        return NULL;
    if (atomic_load_explicit(&table[slot].state, memory_order_acquire) != POISONED)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&table[slot].fault, memory_order_relaxed));
}

static PyObject *repaired(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLong(atomic_load_explicit(&repairs, memory_order_relaxed));
}

static PyObject *reserve(PyObject *self, PyObject *args) {
    int fd;
    long long offset, length;
    if (!PyArg_ParseTuple(args, "iLL", &fd, &offset, &length))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    do { /* tmpfs gives up with EINTR when a signal arrives while it allocates */
        rc = fallocate(fd, 0, (off_t)offset, (off_t)length);
    } while (rc != 0 && errno == EINTR);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"ensure", ensure, METH_NOARGS,
     "Install the SIGBUS guard unless it is the handler now; True if it installed it."},
    {"watch", watch, METH_VARARGS, "watch(address, length) -> slot: guard a mapping."},
    {"unwatch", unwatch, METH_VARARGS, "unwatch(slot): stop guarding it (before it is unmapped)."},
    {"fault", fault, METH_VARARGS, "fault(slot) -> the first faulting address once the mapping was replaced, or None."},
    {"repaired", repaired, METH_NOARGS, "How many mappings the guard has replaced in this process."},
    {"reserve", reserve, METH_VARARGS, "reserve(fd, offset, length): fallocate(2) mode 0, raising OSError."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvbroker.memory._memguard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__memguard(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_WATCHED", MAX_WATCHED) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
