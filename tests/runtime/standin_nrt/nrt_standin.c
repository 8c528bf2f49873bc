/* A stand-in for the Neuron runtime (libnrt.so.1), for tests only: the functions graphc's binding
 * (src/graphc/runtime/neuron_runner.py) calls, with the C layouts it declares, enforcing the
 * contract the Neuron SDK documents (nrt.h; "Neuron Runtime configuration guide"; "runtime
 * developer guide") and recording every call. Two modes:
 * - recording (the default): nrt_execute fills the outputs with zeros, so it shows what graphc asks
 *   of the runtime, never numerics;
 * - executing (GRAPHC_STANDIN_NRT_EXECUTE=1): nrt_execute runs the NEFF's module on XLA:CPU, on the
 *   stand-in's own buffers, through the Python function nrt_standin_executor.execute (the process
 *   is graphc's, a Python process; the module is found on its PYTHONPATH), collectives over gloo:
 *   the whole ctypes path runs, and its tokens can be compared with graphc's XLA:CPU runner's.
 *
 * The contract enforced:
 * - nrt_init takes NRT_FRAMEWORK_TYPE_NO_FW (1) from a direct caller; anything else is an error.
 * - A process reserves every NeuronCore of the "device" unless NEURON_RT_VISIBLE_CORES restricts
 *   it (one lock file per core in $GRAPHC_STANDIN_NRT_DIR); a core another process holds makes
 *   nrt_init fail.
 * - A NeuronCore is addressed relative to the visible ones: vnc 0 .. visible - 1.
 * - A NEFF with collectives loaded for a world of more than one rank needs NEURON_RT_ROOT_COMM_ID.
 * - Each tensor bound for nrt_execute by a NEFF tensor's exact name, at that tensor's size; every
 *   NEFF tensor bound; an output the NEFF aliases to an input bound to that input's tensor.
 * - Tensor info comes in the NEFF's order; what is allocated must be freed: the leaks (allocations
 *   minus frees) are logged at nrt_close, and at exit if nrt_close never came.
 *
 * The stand-in NEFF (what the tests' neuronx-cc stand-in writes) is text:
 *     STANDIN-NEFF 1
 *     collectives <0|1>
 *     tensor <name> <usage: 0 input, 1 output> <bytes> <dtype> <ndim> <dims...>
 *     alias <output name> <input name>
 *     module <bytes>
 * and then that many bytes: the module, serialized, that the executing mode runs.
 *
 * Environment: GRAPHC_STANDIN_NRT_DIR (required: the device's lock files and the call logs,
 * calls-<pid>.log), GRAPHC_STANDIN_NRT_CORES (the device's cores, default 4),
 * GRAPHC_STANDIN_NRT_FAIL=<call>:<rank>:<status> (that call returns that status on that rank),
 * GRAPHC_STANDIN_NRT_HANG=<rank> (that rank's nrt_load_collectives never returns, as when a peer
 * never loads).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first, as Python's C API asks */

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

enum { NRT_SUCCESS = 0, NRT_FAILURE = 1, NRT_INVALID = 2, NRT_INVALID_HANDLE = 3, NRT_RESOURCE = 4,
       NRT_UNINITIALIZED = 13, NRT_CLOSED = 14 };
enum { NRT_FRAMEWORK_TYPE_NO_FW = 1 };
#define NAME_MAX_BYTES 256
#define MAX_DIMS 8
#define MAX_CORES 64

typedef struct {
    char name[NAME_MAX_BYTES];
    int usage;
    size_t size;
    int dtype;
    uint32_t *shape;
    uint32_t ndim;
} nrt_tensor_info_t;

typedef struct {
    uint64_t tensor_count;
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

typedef struct {
    size_t size;
    int vnc;
    char *data;
} nrt_tensor_t;

typedef struct {
    int count, capacity;
    char (*names)[NAME_MAX_BYTES];
    nrt_tensor_t **tensors;
} nrt_tensor_set_t;

typedef struct {
    char name[NAME_MAX_BYTES];
    int usage;
    size_t size;
    int dtype;
    uint32_t ndim;
    uint32_t shape[MAX_DIMS];
    char alias[NAME_MAX_BYTES]; /* an output's aliased input, or "" */
} entry_t;

typedef struct {
    entry_t *entries;
    int count;
    uint32_t rank, world;
    char *module; /* the module the executing mode runs */
    size_t module_size;
} nrt_model_t;

static FILE *call_log;
static int initialized, closed;
static int core_locks[MAX_CORES], locked_cores;
static int visible_count;
static long live_tensors, live_models, live_sets, live_infos;

static const char *env_or(const char *name, const char *otherwise) {
    const char *value = getenv(name);
    return value ? value : otherwise;
}

static void record(const char *format, ...) __attribute__((format(printf, 1, 2)));
static void record(const char *format, ...) {
    if (!call_log) {
        const char *dir = getenv("GRAPHC_STANDIN_NRT_DIR");
        char path[4096];
        if (!dir)
            return;
        snprintf(path, sizeof path, "%s/calls-%d.log", dir, (int)getpid());
        call_log = fopen(path, "a");
        if (!call_log)
            return;
    }
    va_list args;
    va_start(args, format);
    vfprintf(call_log, format, args);
    va_end(args);
    fputc('\n', call_log);
    fflush(call_log);
}

/* The status GRAPHC_STANDIN_NRT_FAIL asks `call` to return on `rank`, or 0. */
static int injected(const char *call, uint32_t rank) {
    const char *spec = getenv("GRAPHC_STANDIN_NRT_FAIL");
    char name[128];
    unsigned target;
    int status;
    if (!spec || sscanf(spec, "%127[^:]:%u:%d", name, &target, &status) != 3)
        return 0;
    return strcmp(name, call) == 0 && target == rank ? status : 0;
}

static void release_cores(void) {
    for (int i = 0; i < locked_cores; i++)
        close(core_locks[i]); /* closing the descriptor drops its flock */
    locked_cores = 0;
}

/* The cores NEURON_RT_VISIBLE_CORES names ("2", "0-3", "1,3"), or every core; -1 if malformed. */
static int visible_cores(int *cores, int device_cores) {
    const char *spec = getenv("NEURON_RT_VISIBLE_CORES");
    int count = 0;
    if (!spec) {
        for (int i = 0; i < device_cores; i++)
            cores[count++] = i;
        return count;
    }
    char copy[256];
    snprintf(copy, sizeof copy, "%s", spec);
    for (char *part = strtok(copy, ","); part; part = strtok(NULL, ",")) {
        int first, last;
        char end;
        if (sscanf(part, "%d-%d%c", &first, &last, &end) != 2) {
            if (sscanf(part, "%d%c", &first, &end) != 1)
                return -1;
            last = first;
        }
        if (first < 0 || last < first || last >= device_cores)
            return -1;
        for (int core = first; core <= last && count < MAX_CORES; core++)
            cores[count++] = core;
    }
    return count;
}

int nrt_init(int framework, const char *fw_version, const char *fal_version) {
    const char *dir = getenv("GRAPHC_STANDIN_NRT_DIR");
    int device_cores = atoi(env_or("GRAPHC_STANDIN_NRT_CORES", "4")), cores[MAX_CORES];
    (void)fw_version;
    (void)fal_version;
    record("nrt_init framework=%d visible_cores=%s root_comm_id=%s exec_timeout=%s fi_provider=%s "
           "fi_efa_use_device_rdma=%s fi_efa_fork_safe=%s", framework, env_or("NEURON_RT_VISIBLE_CORES", "-"),
           env_or("NEURON_RT_ROOT_COMM_ID", "-"), env_or("NEURON_RT_EXEC_TIMEOUT", "-"), env_or("FI_PROVIDER", "-"),
           env_or("FI_EFA_USE_DEVICE_RDMA", "-"), env_or("FI_EFA_FORK_SAFE", "-"));
    if (!dir) {
        fprintf(stderr, "nrt stand-in: GRAPHC_STANDIN_NRT_DIR is not set\n");
        return NRT_FAILURE;
    }
    if (initialized) {
        record("error: nrt_init called twice");
        return NRT_FAILURE;
    }
    if (framework != NRT_FRAMEWORK_TYPE_NO_FW) {
        record("error: framework %d; a direct caller passes NRT_FRAMEWORK_TYPE_NO_FW (1)", framework);
        return NRT_INVALID;
    }
    int count = visible_cores(cores, device_cores);
    if (count <= 0) {
        record("error: NEURON_RT_VISIBLE_CORES=%s names no core of the %d", env_or("NEURON_RT_VISIBLE_CORES", ""),
               device_cores);
        return NRT_INVALID;
    }
    for (int i = 0; i < count; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/core%d.lock", dir, cores[i]);
        int fd = open(path, O_CREAT | O_RDWR, 0644);
        if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) {
            record("error: NeuronCore %d is reserved by another process", cores[i]);
            if (fd >= 0)
                close(fd);
            release_cores();
            return NRT_RESOURCE;
        }
        core_locks[locked_cores++] = fd;
    }
    visible_count = count;
    initialized = 1;
    record("reserved cores=%d", count);
    return NRT_SUCCESS;
}

static void log_leaks(const char *when) {
    record("%s leaked_tensors=%ld leaked_models=%ld leaked_tensor_sets=%ld leaked_tensor_infos=%ld", when, live_tensors,
           live_models, live_sets, live_infos);
}

void nrt_close(void) {
    log_leaks("nrt_close");
    release_cores();
    initialized = 0;
    closed = 1;
}

__attribute__((destructor)) static void at_exit(void) {
    if (initialized && !closed)
        log_leaks("exit-without-nrt_close");
}

/* The NEFF's text part (`text`, NUL-terminated where its module begins) into `model`; the module's
 * size in `*module_size`, its offset from the start in `*module_at`. */
static int parse_neff(const char *text, nrt_model_t *model, int *collectives, size_t *module_size, size_t *module_at) {
    const char *line = text;
    int capacity = 0;
    if (strncmp(text, "STANDIN-NEFF 1\n", 15) != 0)
        return -1;
    while ((line = strchr(line, '\n')) && *++line) {
        entry_t entry;
        int consumed;
        memset(&entry, 0, sizeof entry);
        if (sscanf(line, "collectives %d", collectives) == 1)
            continue;
        if (sscanf(line, "module %zu%n", module_size, &consumed) == 1 && line[consumed] == '\n') {
            *module_at = (size_t)(line + consumed + 1 - text);
            return 0;
        }
        if (sscanf(line, "alias %255s %255s", entry.name, entry.alias) == 2) {
            for (int i = 0; i < model->count; i++)
                if (strcmp(model->entries[i].name, entry.name) == 0)
                    strcpy(model->entries[i].alias, entry.alias);
            continue;
        }
        if (sscanf(line, "tensor %255s %d %zu %d %u%n", entry.name, &entry.usage, &entry.size, &entry.dtype, &entry.ndim,
                   &consumed) != 5 || entry.ndim > MAX_DIMS)
            return -1;
        const char *dims = line + consumed;
        for (uint32_t d = 0; d < entry.ndim; d++) {
            int used;
            if (sscanf(dims, " %u%n", &entry.shape[d], &used) != 1)
                return -1;
            dims += used;
        }
        if (model->count == capacity) {
            capacity = capacity ? 2 * capacity : 64;
            model->entries = realloc(model->entries, capacity * sizeof(entry_t));
        }
        model->entries[model->count++] = entry;
    }
    return 0;
}

int nrt_load_collectives(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count, uint32_t g_device_id,
                         uint32_t g_device_count, nrt_model_t **model) {
    int status = injected("nrt_load_collectives", g_device_id), collectives = 0;
    const char *hang = getenv("GRAPHC_STANDIN_NRT_HANG");
    record("nrt_load_collectives vnc=%d vnc_count=%d rank=%u world=%u root_comm_id=%s", vnc, vnc_count, g_device_id,
           g_device_count, env_or("NEURON_RT_ROOT_COMM_ID", "-"));
    if (status)
        return status;
    if (hang && (uint32_t)atoi(hang) == g_device_id)
        for (;;)
            pause();
    if (!initialized)
        return NRT_UNINITIALIZED;
    if (vnc < 0 || vnc_count < 1 || vnc + vnc_count > visible_count) {
        record("error: vnc %d (count %d) outside the %d visible core(s): vnc counts from the first visible core", vnc,
               vnc_count, visible_count);
        return NRT_INVALID;
    }
    if (g_device_id >= g_device_count || !neff_bytes || !model) {
        record("error: rank %u of world %u", g_device_id, g_device_count);
        return NRT_INVALID;
    }
    char *text = malloc(size + 1);
    memcpy(text, neff_bytes, size);
    text[size] = 0;
    nrt_model_t *loaded = calloc(1, sizeof *loaded);
    size_t module_size = 0, module_at = size;
    int parsed = parse_neff(text, loaded, &collectives, &module_size, &module_at);
    free(text);
    if (parsed == 0 && module_at + module_size != size)
        parsed = -1; /* a module cut short, or bytes after it */
    if (parsed == 0 && module_size) {
        loaded->module = malloc(module_size);
        memcpy(loaded->module, (const char *)neff_bytes + module_at, module_size);
        loaded->module_size = module_size;
    }
    if (parsed != 0) {
        record("error: not a stand-in NEFF");
        free(loaded->entries);
        free(loaded);
        return NRT_INVALID;
    }
    if (g_device_count > 1 && collectives && !getenv("NEURON_RT_ROOT_COMM_ID")) {
        record("error: NEURON_RT_ROOT_COMM_ID is not set; a NEFF with collectives over %u ranks needs it", g_device_count);
        free(loaded->entries);
        free(loaded);
        return NRT_INVALID;
    }
    loaded->rank = g_device_id;
    loaded->world = g_device_count;
    *model = loaded;
    live_models++;
    record("loaded tensors=%d collectives=%d", loaded->count, collectives);
    return NRT_SUCCESS;
}

int nrt_unload(nrt_model_t *model) {
    record("nrt_unload");
    if (!model)
        return NRT_INVALID_HANDLE;
    free(model->entries);
    free(model->module);
    free(model);
    live_models--;
    return NRT_SUCCESS;
}

int nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **info) {
    if (!model || !info)
        return NRT_INVALID_HANDLE;
    nrt_tensor_info_array_t *array = calloc(1, sizeof *array + model->count * sizeof(nrt_tensor_info_t));
    array->tensor_count = model->count;
    for (int i = 0; i < model->count; i++) { /* the NEFF's order */
        entry_t *entry = &model->entries[i];
        nrt_tensor_info_t *out = &array->tensor_array[i];
        strcpy(out->name, entry->name);
        out->usage = entry->usage;
        out->size = entry->size;
        out->dtype = entry->dtype;
        out->ndim = entry->ndim;
        out->shape = calloc(entry->ndim + 1, sizeof(uint32_t));
        memcpy(out->shape, entry->shape, entry->ndim * sizeof(uint32_t));
    }
    *info = array;
    live_infos++;
    return NRT_SUCCESS;
}

int nrt_free_model_tensor_info(nrt_tensor_info_array_t *info) {
    if (!info)
        return NRT_INVALID_HANDLE;
    for (uint64_t i = 0; i < info->tensor_count; i++)
        free(info->tensor_array[i].shape);
    free(info);
    live_infos--;
    return NRT_SUCCESS;
}

int nrt_tensor_allocate(int placement, int vnc, size_t size, const char *name, nrt_tensor_t **tensor) {
    if (!initialized)
        return NRT_UNINITIALIZED;
    if (vnc < 0 || vnc >= visible_count) {
        record("error: nrt_tensor_allocate(%s) on vnc %d; %d core(s) visible", name ? name : "?", vnc, visible_count);
        return NRT_INVALID;
    }
    if (placement != 0 || !tensor) {
        record("error: nrt_tensor_allocate(%s) placement %d", name ? name : "?", placement);
        return NRT_INVALID;
    }
    nrt_tensor_t *made = calloc(1, sizeof *made);
    made->size = size;
    made->vnc = vnc;
    made->data = calloc(size ? size : 1, 1);
    *tensor = made;
    live_tensors++;
    return NRT_SUCCESS;
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (!tensor || !*tensor)
        return;
    free((*tensor)->data);
    free(*tensor);
    *tensor = NULL;
    live_tensors--;
}

int nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    if (!tensor)
        return NRT_INVALID_HANDLE;
    if (offset + size > tensor->size) {
        record("error: nrt_tensor_write of %zu bytes at %zu into a tensor of %zu", size, offset, tensor->size);
        return NRT_INVALID;
    }
    memcpy(tensor->data + offset, buf, size);
    return NRT_SUCCESS;
}

int nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    if (!tensor)
        return NRT_INVALID_HANDLE;
    if (offset + size > tensor->size) {
        record("error: nrt_tensor_read of %zu bytes at %zu from a tensor of %zu", size, offset, tensor->size);
        return NRT_INVALID;
    }
    memcpy(buf, tensor->data + offset, size);
    return NRT_SUCCESS;
}

size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) { return tensor ? tensor->size : 0; }

int nrt_allocate_tensor_set(nrt_tensor_set_t **set) {
    if (!set)
        return NRT_INVALID;
    *set = calloc(1, sizeof **set);
    live_sets++;
    return NRT_SUCCESS;
}

void nrt_destroy_tensor_set(nrt_tensor_set_t **set) {
    if (!set || !*set)
        return;
    free((*set)->names);
    free((*set)->tensors);
    free(*set);
    *set = NULL;
    live_sets--;
}

int nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *set, const char *name, nrt_tensor_t *tensor) {
    if (!set || !name || !tensor || strlen(name) >= NAME_MAX_BYTES)
        return NRT_INVALID;
    for (int i = 0; i < set->count; i++)
        if (strcmp(set->names[i], name) == 0) {
            set->tensors[i] = tensor;
            return NRT_SUCCESS;
        }
    if (set->count == set->capacity) {
        set->capacity = set->capacity ? 2 * set->capacity : 64;
        set->names = realloc(set->names, set->capacity * sizeof *set->names);
        set->tensors = realloc(set->tensors, set->capacity * sizeof *set->tensors);
    }
    strcpy(set->names[set->count], name);
    set->tensors[set->count++] = tensor;
    return NRT_SUCCESS;
}

static nrt_tensor_t *bound(const nrt_tensor_set_t *set, const char *name) {
    for (int i = 0; i < set->count; i++)
        if (strcmp(set->names[i], name) == 0)
            return set->tensors[i];
    return NULL;
}

static const entry_t *entry_of(const nrt_model_t *model, const char *name, int usage) {
    for (int i = 0; i < model->count; i++)
        if (model->entries[i].usage == usage && strcmp(model->entries[i].name, name) == 0)
            return &model->entries[i];
    return NULL;
}

/* The parameter or result number of a NEFF tensor named input<N>[.must_alias_input] / output<N>, or -1. */
static int number_of(const entry_t *entry) {
    unsigned number;
    int consumed = 0;
    const char *prefix = entry->usage ? "output%u%n" : "input%u%n";
    if (sscanf(entry->name, prefix, &number, &consumed) != 1)
        return -1;
    const char *rest = entry->name + consumed;
    return *rest == 0 || (!entry->usage && strcmp(rest, ".must_alias_input") == 0) ? (int)number : -1;
}

/* Executing mode: nrt_standin_executor.execute(module, rank, world, inputs, outputs), each tensor
 * a writable memoryview of the stand-in's buffer, by parameter / result number. The Python call
 * takes the GIL (ctypes released it for this call). */
static int run_module(nrt_model_t *model, const nrt_tensor_set_t *inputs, nrt_tensor_set_t *outputs) {
    int counts[2] = {0, 0}, status = NRT_FAILURE;
    if (!model->module) {
        record("error: nrt_execute: executing mode, but the NEFF holds no module");
        return NRT_INVALID;
    }
    for (int i = 0; i < model->count; i++)
        counts[model->entries[i].usage]++;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *views[2] = {PyList_New(counts[0]), PyList_New(counts[1])}, *executor = NULL, *done = NULL;
    for (int i = 0; i < model->count; i++) {
        const entry_t *entry = &model->entries[i];
        int number = number_of(entry);
        if (number < 0 || number >= counts[entry->usage]) {
            record("error: nrt_execute: NEFF tensor %s is not named input<N> / output<N>", entry->name);
            goto out;
        }
        nrt_tensor_t *tensor = bound(entry->usage ? outputs : inputs, entry->name);
        PyList_SetItem(views[entry->usage], number, PyMemoryView_FromMemory(tensor->data, tensor->size, PyBUF_WRITE));
    }
    executor = PyImport_ImportModule("nrt_standin_executor");
    if (executor)
        done = PyObject_CallMethod(executor, "execute", "y#IIOO", model->module, (Py_ssize_t)model->module_size,
                                   model->rank, model->world, views[0], views[1]);
    if (done)
        status = NRT_SUCCESS;
    else {
        record("error: nrt_execute: the executor failed (its traceback is on stderr)");
        PyErr_Print();
    }
out:
    Py_XDECREF(done);
    Py_XDECREF(executor);
    Py_XDECREF(views[0]);
    Py_XDECREF(views[1]);
    PyGILState_Release(gil);
    return status;
}

int nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *inputs, nrt_tensor_set_t *outputs) {
    if (!model || !inputs || !outputs)
        return NRT_INVALID_HANDLE;
    int status = injected("nrt_execute", model->rank);
    record("nrt_execute rank=%u", model->rank);
    if (status)
        return status;
    for (int usage = 0; usage < 2; usage++) {
        const nrt_tensor_set_t *set = usage ? outputs : inputs;
        for (int i = 0; i < set->count; i++)
            if (!entry_of(model, set->names[i], usage)) {
                record("error: nrt_execute: %s %s is no tensor of the NEFF", usage ? "output" : "input", set->names[i]);
                return NRT_INVALID;
            }
    }
    for (int i = 0; i < model->count; i++) {
        const entry_t *entry = &model->entries[i];
        nrt_tensor_t *tensor = bound(entry->usage ? outputs : inputs, entry->name);
        if (!tensor) {
            record("error: nrt_execute: NEFF tensor %s is not bound", entry->name);
            return NRT_INVALID;
        }
        if (tensor->size != entry->size) {
            record("error: nrt_execute: NEFF tensor %s is %zu bytes, bound to a tensor of %zu", entry->name, entry->size,
                   tensor->size);
            return NRT_INVALID;
        }
        if (entry->alias[0] && bound(inputs, entry->alias) != tensor) {
            record("error: nrt_execute: output %s must alias input %s, bound to another tensor", entry->name,
                   entry->alias);
            return NRT_INVALID;
        }
    }
    if (strcmp(env_or("GRAPHC_STANDIN_NRT_EXECUTE", "0"), "1") == 0)
        return run_module(model, inputs, outputs);
    for (int i = 0; i < model->count; i++) /* recording mode: outputs are zeros; an aliased one is kept */
        if (model->entries[i].usage == 1 && !model->entries[i].alias[0]) {
            nrt_tensor_t *tensor = bound(outputs, model->entries[i].name);
            memset(tensor->data, 0, tensor->size);
        }
    return NRT_SUCCESS;
}
