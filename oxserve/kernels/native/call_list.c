/* A captured step's native kernel calls, run from C: ctypes spends 0.4-1.9 us converting the
 * arguments of every call (a decode step makes ~140), where libffi, given them once, calls
 * each function directly. `prepare_call` describes a signature once; `run_calls` then calls a
 * list of (function, signature, argument values) in order, checking each int result against
 * the one the recording saw (a failure status fails the step, as `StepRecording.replay`
 * would). Argument values live in 8-byte slots (an int32 or float in the slot's low bytes). */
#include <ffi.h>
#include <stdint.h>
#include <stdlib.h>

enum { ARG_POINTER, ARG_INT64, ARG_INT32, ARG_FLOAT, ARG_DOUBLE, ARG_UINT8 };

static ffi_type *arg_type(uint8_t code) {
    switch (code) {
    case ARG_POINTER: return &ffi_type_pointer;
    case ARG_INT64: return &ffi_type_sint64;
    case ARG_INT32: return &ffi_type_sint32;
    case ARG_FLOAT: return &ffi_type_float;
    case ARG_DOUBLE: return &ffi_type_double;
    case ARG_UINT8: return &ffi_type_uint8;
    default: return NULL;
    }
}

/* A call interface for `nargs` arguments of the given codes returning an int (`returns_int`)
 * or nothing; NULL for an unknown code or no memory. Kept for the process's life (one per
 * kernel signature). */
void *prepare_call(int nargs, const uint8_t *codes, int returns_int) {
    ffi_cif *cif = malloc(sizeof(ffi_cif));
    ffi_type **types = malloc((size_t)(nargs > 0 ? nargs : 1) * sizeof(ffi_type *));
    if (cif == NULL || types == NULL) goto fail;
    for (int i = 0; i < nargs; i++)
        if ((types[i] = arg_type(codes[i])) == NULL) goto fail;
    if (ffi_prep_cif(cif, FFI_DEFAULT_ABI, (unsigned)nargs, returns_int ? &ffi_type_sint32 : &ffi_type_void, types) == FFI_OK)
        return cif;
fail:
    free(cif);
    free(types);
    return NULL;
}

/* `team.c`'s, where it is loaded (OXSERVE_OMP_TEAM=0 leaves the kernels on libgomp). */
int team_begin(void) __attribute__((weak));
void team_end(void) __attribute__((weak));

/* Calls i = 0 .. n-1: functions[i] through cifs[i] with the argument slots values[i] (an
 * array of pointers to them), their OpenMP regions on the spinning team. Returns -1, or the
 * first call whose int result differs from expected[i] where checks[i] (its result in *got). */
int64_t run_calls(int64_t n, void **functions, void **cifs, void ***values, const int64_t *expected,
                  const uint8_t *checks, int64_t *got) {
    if (team_begin) team_begin();
    int64_t failed = -1;
    for (int64_t i = 0; i < n && failed < 0; i++) {
        ffi_sarg result = 0;
        ffi_call((ffi_cif *)cifs[i], FFI_FN(functions[i]), &result, values[i]);
        if (checks[i] && (int64_t)(int)result != expected[i]) {
            *got = (int)result;
            failed = i;
        }
    }
    if (team_end) team_end();
    return failed;
}
