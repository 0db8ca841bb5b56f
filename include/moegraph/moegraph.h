/* moegraph C ABI: a thin layer over moegraph::GroupedLinear (mg_grouped_linear_*), moegraph::MoeLayer
 * (mg_moe_layer_*), the capture-and-replay runtime moegraph::StepGraphs (mg_config_*,
 * mg_step_graphs_*) and the expert-parallel communicators moegraph::EpComm (mg_ep_comm_*).
 *
 * Conventions
 * - No exception crosses it: every call returns a status; mg_status_string() names a status and
 *   mg_last_error() gives the message of this thread's last failure (empty after a success).
 * - Every struct passed in or out starts with its own size, so it can grow without breaking callers
 *   built against older headers: zero it and set struct_size = sizeof(the struct) (the *_init
 *   functions do), e.g. `mg_forward_args a = {0}; a.struct_size = sizeof(a);`. The library reads
 *   only the fields a caller's size covers (later ones take their defaults) and refuses a struct
 *   larger than it knows unless the unknown tail is zero. Fields are only ever appended, and a
 *   field's zero value is its default wherever that can be (expert_parallel 0 means 1).
 * - Handles are checked: a null handle, or one already destroyed, gives MG_ERR_INVALID_HANDLE (a
 *   destroyed handle's address may be reused by a later create, which then owns it).
 * - Enqueue calls (forward, backward, backward_dw, weights_changed, replay, run_eager) are
 *   graph-capturable, as in the C++ API; create, destroy, read_dropped and check_device_errors are
 *   not (they may allocate or synchronize).
 * - Threading: a handle is used by one thread at a time and is bound to the device current at
 *   create, which it makes current for each call (any thread may call it, whatever device that
 *   thread has current); distinct handles may run on distinct threads (the whole contract is in
 *   moegraph/step_graphs.hpp).
 * Version: MOEGRAPH_VERSION (moegraph/version.h) is the headers', mg_version() the library's. */
#ifndef MOEGRAPH_MOEGRAPH_H_
#define MOEGRAPH_MOEGRAPH_H_

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "moegraph/export.h"
#include "moegraph/version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MG_OK = 0,
  MG_ERR_INVALID_ARGUMENT = 1,   /* bad options or arguments; nothing was enqueued */
  MG_ERR_CUDA = 2,               /* a CUDA runtime call failed */
  MG_ERR_LIBRARY = 3,            /* cuBLASLt or NCCL failed */
  MG_ERR_DEVICE_SPLITS = 4,      /* the device recorded invalid inputs: splits or a token count (check_device_errors) */
  MG_ERR_INTERNAL = 5,
  MG_ERR_NO_DEVICE = 6,          /* no usable CUDA device */
  MG_ERR_UNSUPPORTED_DEVICE = 7, /* the device is not compute capability 9.0 (Hopper) */
  MG_ERR_CONFIG = 8,             /* a config file or text was refused: malformed, unknown key, bad value */
  MG_ERR_INVALID_HANDLE = 9      /* a null handle, or one already destroyed */
} mg_status;

/* A constant description of `status` ("invalid argument", ...); "unknown status" for other values. */
MOEGRAPH_API const char* mg_status_string(mg_status status);
/* This thread's last failure message ("" after a success). Valid until this thread's next call. */
MOEGRAPH_API const char* mg_last_error(void);
/* The loaded library's version: MAJOR * 10000 + MINOR * 100 + PATCH (compare with MOEGRAPH_VERSION). */
MOEGRAPH_API int mg_version(void);
/* The NCCL version the library runs with (ncclGetVersion). */
MOEGRAPH_API int mg_nccl_version(void);

/* Each enum spans every int32 (the *_FORCE_* values), so any int a caller stores in an enum field
   is a value of the type, refused by name, never undefined behaviour. */
typedef enum { MG_DTYPE_BF16 = 0, MG_DTYPE_FP16 = 1, MG_DTYPE_FORCE_INT32 = 0x7fffffff,
               MG_DTYPE_FORCE_SIGNED = -0x7fffffff - 1 } mg_dtype;
/* MG_RECIPE_MXFP8: the GEMMs run on MXFP8 copies (K, N multiples of 128; training needs row_align
 * 32 or 128, inference runs at any row_align);
 * quantize the weights with the *_weights_changed call before the first forward and after every
 * weight update, or give them already quantized (prequantized_weights, see MXFP8 weights below). */
typedef enum { MG_RECIPE_BF16 = 0, MG_RECIPE_MXFP8 = 1, MG_RECIPE_FORCE_INT32 = 0x7fffffff,
               MG_RECIPE_FORCE_SIGNED = -0x7fffffff - 1 } mg_recipe;

/* ---- MXFP8 weights given by the caller (moegraph/mxfp8_weights.hpp) ----
 *
 * With MG_RECIPE_MXFP8 and prequantized_weights set in the options, the GEMMs read expert weights
 * the caller holds already quantized (an MXFP8 checkpoint, or one copy shared by several layers)
 * and the operator keeps no copy of its own: the 16-bit weights are neither needed nor read, and
 * the *_weights_changed calls have nothing to do (mg_grouped_linear_weights_changed is refused).
 * Grouped weights W [G, N, K] (G experts of N outputs and K inputs) as four device arrays, each
 * 16-byte aligned, E4M3 elements and E8M0 scales as docs/mxfp8.md defines them:
 *   data     [G, N, K]       element (e, n, k) at (e * N + n) * K + k
 *   scales   [G, N, K / 32]  the block of inputs [32j, 32j + 32) of (e, n) at (e * N + n) * (K / 32) + j
 *   data_t   [G, K, N]       each W_e^T: element (e, n, k) at (e * K + k) * N + n
 *   scales_t [G, K, N / 32]  the block of outputs [32j, 32j + 32) of (e, k) at (e * K + k) * (N / 32) + j
 * The forward reads data and scales; training's backward (dx) reads data_t and scales_t, so
 * inference needs the first pair alone. w1 [E, 2 * ffn, hidden] is N = 2 * ffn, K = hidden; w2
 * [E, hidden, ffn] is N = hidden, K = ffn. mg_quantize_mxfp8_weights makes them from 16-bit weights,
 * bit for bit what the recipe's own weights_changed makes.
 * The structs carry the four pointers as fields of their own (mxfp8_data, mxfp8_scales, ... and
 * w1_mxfp8_data, ...) rather than an embedded struct: every struct of this ABI starts with its size,
 * and an embedded one would either break that rule or carry a size no caller can keep apart from
 * its container's. */

/* *data_bytes = the bytes of data (and of data_t), G * N * K; *scale_bytes = those of scales (and of
 * scales_t), G * N * K / 32. groups in [1, 1024]; n and k multiples of 32 in [32, 2^21]. Touches no
 * GPU. On failure both are 0 and mg_last_error names the size, its value and the rule. */
MOEGRAPH_API mg_status mg_mxfp8_weight_bytes(int groups, int64_t n, int64_t k, size_t* data_bytes,
                                             size_t* scale_bytes);
/* Quantizes w [groups, n, k] (dtype, device) into the pairs given: data with scales, data_t with
 * scales_t (a pair is both pointers or neither; at least one pair), sized by mg_mxfp8_weight_bytes.
 * Every argument is checked before any GPU use (MG_ERR_INVALID_ARGUMENT naming it). Enqueued on
 * `stream` and graph-capturable: it never synchronizes, allocates or reads device memory on the host.
 * Call it again after every update of w (the layers and steps that read the copies see the new
 * bytes at their next enqueue). */
MOEGRAPH_API mg_status mg_quantize_mxfp8_weights(mg_dtype dtype, const void* w, int groups, int64_t n, int64_t k,
                                                 uint8_t* data, uint8_t* scales, uint8_t* data_t, uint8_t* scales_t,
                                                 cudaStream_t stream);
/* The weights' values kept dequantized to bf16, for operators and steps with dequantized_weights
 * (mxfp8, bf16 activations; docs/mxfp8.md, "Dequantized weights"): `values` [G, N, K] from data and
 * scales, `values_t` [G, K, N] from data_t and scales_t, each 2 * G * N * K bytes, 16-byte aligned;
 * either may be NULL, and each needs its pair. Those operators read them as mxfp8_dequantized and
 * mxfp8_dequantized_t (mg_forward_args, mg_backward_args) or w1_mxfp8_dequantized, ... (the
 * weight structs) with prequantized_weights; call it after every mg_quantize_mxfp8_weights. Checked
 * before any GPU use; enqueued on `stream`, graph-capturable. */
MOEGRAPH_API mg_status mg_dequantize_mxfp8_weights(int groups, int64_t n, int64_t k, const uint8_t* data,
                                                   const uint8_t* scales, const uint8_t* data_t,
                                                   const uint8_t* scales_t, void* values, void* values_t,
                                                   cudaStream_t stream);
/* Optional: the scales again in the tile order of the MXFP8 GEMM route for groups of few rows
 * (decode, fine-grained experts: the swap-AB route `--plan` prints; docs/mxfp8.md, "Tiled scales").
 * With them each stage of that route copies its weights' scales whole; without them it gathers them
 * from scales and scales_t (the same results, measured slower: docs/PERF.md). *bytes = the bytes of
 * one tiled copy, 512 * G * ceil(N / 128) * ceil(K / 128) (the same for the copy of scales_t). Sizes
 * as mg_mxfp8_weight_bytes takes them; on failure *bytes is 0. Touches no GPU. */
MOEGRAPH_API mg_status mg_mxfp8_tiled_scale_bytes(int groups, int64_t n, int64_t k, size_t* bytes);
/* Writes `tiled` from scales and `tiled_t` from scales_t (either may be NULL, at least one; each
 * needs its pair; 16-byte aligned, mg_mxfp8_tiled_scale_bytes each). Operators read them as
 * mxfp8_scales_tiled and mxfp8_scales_t_tiled (mg_forward_args, mg_backward_args) or
 * w1_mxfp8_scales_tiled, ... (the weight structs) with prequantized_weights; call it after every
 * mg_quantize_mxfp8_weights. Checked before any GPU use; enqueued on `stream`, graph-capturable. */
MOEGRAPH_API mg_status mg_tile_mxfp8_weight_scales(int groups, int64_t n, int64_t k, const uint8_t* data,
                                                   const uint8_t* scales, const uint8_t* data_t,
                                                   const uint8_t* scales_t, uint8_t* tiled, uint8_t* tiled_t,
                                                   cudaStream_t stream);

/* ---- Grouped linear (moegraph::GroupedLinear): G linear layers over one grouped-row buffer ---- */

typedef struct mg_grouped_linear mg_grouped_linear;

/* Limits (MG_ERR_INVALID_ARGUMENT past them, and mg_last_error names the field, its value and the
 * limit): num_groups 1..1024; in_features and out_features multiples of 16, at most 2^21;
 * capacity_rows 1..2^31 - 1; capacity_rows * max(K, N) * element size and num_groups * N * K * 4 at
 * most 2^48 bytes, and so the whole workspace. */
typedef struct {
  size_t struct_size;    /* sizeof(mg_grouped_linear_options) */
  int num_groups;        /* G, 1..1024 */
  int64_t in_features;   /* K, multiple of 16, at most 2^21 */
  int64_t out_features;  /* N, multiple of 16, at most 2^21 */
  int64_t capacity_rows; /* 1..2^31 - 1, a multiple of row_align */
  int row_align;         /* 1, 16, 32, 128 */
  mg_dtype dtype;
  int bias;              /* bool */
  int wgrad_slots;       /* 1..64 */
  int delay_wgrad;       /* bool */
  mg_recipe recipe;
  /* Appended (a caller's older struct_size leaves it at its default, 0). */
  int prequantized_weights; /* bool, MG_RECIPE_MXFP8 only: the GEMMs read the caller's MXFP8 weights
                               (mg_forward_args / mg_backward_args mxfp8_*); weight may be NULL */
  /* Appended after prequantized_weights (an older struct_size leaves it at 0). 64 bits wide so that it
     begins past the previous release's tail padding, which an older caller may leave unset. */
  int64_t dequantized_weights; /* bool, MG_RECIPE_MXFP8 with bf16 only: the MXFP8 weights are also kept
                                  dequantized to bf16 (4 bytes more per weight element), made by
                                  weights_changed, or the caller's (mxfp8_dequantized*) with
                                  prequantized_weights; fprop and dgrad then run near the bf16 speed */
  /* Appended after dequantized_weights (an older struct_size leaves it at 0). */
  int64_t forward_only;        /* bool: the operator serves mg_grouped_linear_forward only and lays out no
                                  training contexts (a smaller workspace); forward_train is refused, and
                                  delay_wgrad must be 0 */
} mg_grouped_linear_options;

/* Device pointers; every row buffer has capacity_rows rows (moegraph/grouped_linear.hpp). */
typedef struct {
  size_t struct_size;       /* sizeof(mg_forward_args) */
  const void* x;            /* [capacity_rows, K] */
  const int32_t* splits;    /* [G] */
  const void* weight;       /* [G, N, K] */
  const void* bias;         /* [G, N] or NULL */
  const float* bias_scale;  /* [capacity_rows] or NULL */
  void* y;                  /* [capacity_rows, N] */
  const int64_t* offsets;   /* NULL, or [G + 1] group offsets already computed for these splits; a
                               training forward given offsets keeps pointers to splits and offsets
                               (no copies): both must stay unchanged until that micro-batch's
                               backward (and delayed wgrad) has run */
  /* Appended (an older struct_size means NULL): W as MXFP8 with prequantized_weights, which the
     forward reads through mxfp8_data and mxfp8_scales (see MXFP8 weights) */
  const uint8_t* mxfp8_data;     /* [G, N, K] */
  const uint8_t* mxfp8_scales;   /* [G, N, K / 32] */
  const uint8_t* mxfp8_data_t;   /* [G, K, N]: not read by the forward */
  const uint8_t* mxfp8_scales_t; /* [G, K, N / 32]: not read by the forward */
  /* Appended (an older struct_size means NULL): with prequantized_weights and dequantized_weights,
     the values of mxfp8_data (mg_dequantize_mxfp8_weights) */
  const void* mxfp8_dequantized;   /* [G, N, K] bf16 */
  const void* mxfp8_dequantized_t; /* [G, K, N] bf16: not read by the forward */
  /* Appended (an older struct_size means NULL): optional with prequantized_weights, the tiled
     copies of mxfp8_scales and mxfp8_scales_t (mg_tile_mxfp8_weight_scales) */
  const uint8_t* mxfp8_scales_tiled;   /* read where the forward takes the swap-AB route */
  const uint8_t* mxfp8_scales_t_tiled; /* not read by the forward */
} mg_forward_args;

typedef struct {
  size_t struct_size;  /* sizeof(mg_backward_args) */
  const void* dy;      /* [capacity_rows, N] */
  const void* weight;  /* [G, N, K] */
  const void* bias;    /* [G, N]; needed for dbias_scale */
  void* dx;            /* [capacity_rows, K] or NULL */
  void* dbias;         /* [G, N] or NULL */
  float* dbias_scale;  /* [capacity_rows] or NULL */
  void* dweight;       /* [G, N, K] written, or */
  float* main_grad;    /* [G, N, K] fp32 accumulated into */
  /* Appended (an older struct_size means NULL): W as MXFP8 with prequantized_weights, which dx
     reads through mxfp8_data_t and mxfp8_scales_t (see MXFP8 weights) */
  const uint8_t* mxfp8_data;     /* [G, N, K]: not read by the backward */
  const uint8_t* mxfp8_scales;   /* [G, N, K / 32]: not read by the backward */
  const uint8_t* mxfp8_data_t;   /* [G, K, N] */
  const uint8_t* mxfp8_scales_t; /* [G, K, N / 32] */
  /* Appended (an older struct_size means NULL): with prequantized_weights and dequantized_weights,
     the values of mxfp8_data_t, which dx reads */
  const void* mxfp8_dequantized;   /* [G, N, K] bf16: not read by the backward */
  const void* mxfp8_dequantized_t; /* [G, K, N] bf16 */
  /* Appended (an older struct_size means NULL): optional with prequantized_weights, the tiled
     copies of mxfp8_scales and mxfp8_scales_t (mg_tile_mxfp8_weight_scales) */
  const uint8_t* mxfp8_scales_tiled;   /* not read by the backward */
  const uint8_t* mxfp8_scales_t_tiled; /* read where dx takes the swap-AB route */
} mg_backward_args;

/* Fills *options with the defaults (struct_size set; row_align 1, bf16, no bias, one slot, no delay,
 * not prequantized). Called as mg_grouped_linear_options_init(&o), the macro below passes the
 * struct's size as this header has it to mg_grouped_linear_options_init_sized, which writes that
 * many bytes and no more: a caller built against an older header keeps its smaller struct intact
 * (the fields of its release set, struct_size its own sizeof), and one built against a newer header
 * gets zeros over the fields this library does not know. The function itself (its address, or
 * (mg_grouped_linear_options_init)(&o)) fills sizeof(mg_grouped_linear_options) of this header.
 * _init_sized refuses (MG_ERR_INVALID_ARGUMENT, nothing written) a null pointer or a size below the
 * first release's. */
MOEGRAPH_API void mg_grouped_linear_options_init(mg_grouped_linear_options* options);
MOEGRAPH_API mg_status mg_grouped_linear_options_init_sized(mg_grouped_linear_options* options, size_t struct_size);
#define mg_grouped_linear_options_init(options) mg_grouped_linear_options_init_sized((options), sizeof *(options))
/* Validates the options and gives the workspace size (at most 2^48 bytes). Touches no GPU. On
 * failure *out is 0 and mg_last_error names the field, its value and the limit. */
MOEGRAPH_API mg_status mg_grouped_linear_workspace_bytes(const mg_grouped_linear_options* options, size_t* out);
/* workspace: device memory of mg_grouped_linear_workspace_bytes(options) bytes, 256-byte aligned, that
 * the caller keeps until destroy, or NULL to have the operator allocate its own. Validates and sizes
 * before any CUDA call. Before capture. */
MOEGRAPH_API mg_status mg_grouped_linear_create(const mg_grouped_linear_options* options, void* workspace,
                                                mg_grouped_linear** out);
/* NULL or a destroyed handle: nothing happens. */
MOEGRAPH_API void mg_grouped_linear_destroy(mg_grouped_linear* op);
/* train != 0 saves the context for backward (forward_train). */
MOEGRAPH_API mg_status mg_grouped_linear_forward(mg_grouped_linear* op, const mg_forward_args* args, int train,
                                                 cudaStream_t stream);
/* delay_wgrad != 0 queues the weight gradient for mg_grouped_linear_backward_dw. */
MOEGRAPH_API mg_status mg_grouped_linear_backward(mg_grouped_linear* op, const mg_backward_args* args, int delay_wgrad,
                                                  cudaStream_t stream);
MOEGRAPH_API mg_status mg_grouped_linear_backward_dw(mg_grouped_linear* op, cudaStream_t stream);
/* The weights [G, N, K] changed: MXFP8 re-quantizes its copies, bf16 has nothing to do (enqueued,
   capturable). Call it before the first forward and after every update. Refused with
   prequantized_weights (the caller re-quantizes: mg_quantize_mxfp8_weights). */
MOEGRAPH_API mg_status mg_grouped_linear_weights_changed(mg_grouped_linear* op, const void* weight,
                                                         cudaStream_t stream);
/* Synchronizes the stream; MG_ERR_DEVICE_SPLITS if invalid splits were seen since the last check. */
MOEGRAPH_API mg_status mg_grouped_linear_check_device_errors(mg_grouped_linear* op, cudaStream_t stream);

/* ---- Expert parallelism (moegraph::EpComm): the ranks a MoE layer spreads its experts over ----
 *
 * With R ranks, rank r holds experts [r * E/R, (r + 1) * E/R): its layer's or step's w1, b1, w2, b2
 * (and their gradients) are those E/R experts only, while the router stays whole (its gradient is
 * this rank's tokens' share: sum it over the ranks as for any replicated parameter). Each rank
 * routes its own tokens (max_tokens is per rank), sends every chosen (token, expert) row to the rank
 * owning the expert, and receives the results back, through windows: memory laid out identically on
 * every rank, allocated on the communicator, that the exchange kernels store into directly.
 * - Collective: creating a communicator, and creating a layer or step on one (each allocates its
 *   window on it), are collective: every rank of the group makes the same calls with the same
 *   options in the same order. Steps are too: every rank runs the same sequence of forward,
 *   backward and backward_dw calls (or replays of the same bucket and phase); the token counts may
 *   differ. A rank that falls out of step makes the others' device barriers time out after
 *   MOEGRAPH_EP_TIMEOUT_MS (default 20000) milliseconds, which check_device_errors reports. A
 *   timeout stops that layer's exchanges on the rank, once: later barriers wait for nobody, nothing
 *   is stored into a peer, every later step reports the stop, and a peer still in step reports
 *   it at its next barrier. Results from then on are lost: rebuild the layers and the group.
 * - Transports: NCCL (one process per GPU of one host's NVLink domain: NCCL 2.28 or newer, and
 *   NCCL_NVLS_ENABLE=0 in the environment every rank starts with, and no NCCL environment plugin
 *   named by NCCL_ENV_PLUGIN (unset or "none"; scripts/launch sets none), else creation is refused
 *   with MG_ERR_INVALID_ARGUMENT; the send/recv exchange also needs NCCL_GRAPH_REGISTER=0 and
 *   NCCL_LOCAL_REGISTER=0, else its first exchange fails), or emulated ranks in one process on one
 *   GPU (for tests).
 * - A communicator is bound to the device current when it is created; the layers and steps made
 *   with it are set up on that device (whatever device the creating thread has current) and keep
 *   what they need of it alive, so it may be destroyed before them.
 * - Each rank is driven by its own host thread (NCCL: its own process): the ranks wait for each
 *   other on the device while their steps run. */

typedef struct mg_ep_comm mg_ep_comm;

/* Writes a fresh NCCL unique id, 256 hex digits and a NUL, into out[0..257): size must be at least
 * 257, else MG_ERR_INVALID_ARGUMENT. One rank makes it and hands it to every rank of the group
 * (for mg_ep_comm_create_nccl, or in MOEGRAPH_NCCL_ID). NCCL's bootstrap picks a network interface
 * here (MG_ERR_LIBRARY when it finds none); no GPU is touched. */
MOEGRAPH_API mg_status mg_nccl_unique_id(char* out, size_t size);
/* This process as rank `rank` (0..ranks - 1) of a group of `ranks` (1..64) over NCCL, on the
 * current device, joined by `unique_id_hex` (mg_nccl_unique_id's digits, the same on every rank).
 * Collective: blocks until every rank has called it (ncclCommInitRank). Checked in this order: the
 * arguments (MG_ERR_INVALID_ARGUMENT naming the argument), the environment and NCCL
 * (MG_ERR_INVALID_ARGUMENT without NCCL_NVLS_ENABLE=0 since the process started, with an NCCL
 * environment plugin named by NCCL_ENV_PLUGIN, or with NCCL older than 2.28), the device (MG_ERR_NO_DEVICE, MG_ERR_UNSUPPORTED_DEVICE); a failed NCCL call is
 * MG_ERR_LIBRARY. Every rank must reach every other by load/store (one host's NVLink domain), else
 * MG_ERR_INVALID_ARGUMENT. */
MOEGRAPH_API mg_status mg_ep_comm_create_nccl(int ranks, int rank, const char* unique_id_hex, mg_ep_comm** out);
/* The same from a launcher's environment (scripts/launch): MOEGRAPH_EP_RANKS, MOEGRAPH_EP_RANK,
 * MOEGRAPH_EP_DEVICE (default: the rank; made the current device here), and the unique id in
 * MOEGRAPH_NCCL_ID (hex) or in the file MOEGRAPH_NCCL_ID_FILE, which rank 0 creates (it must not
 * exist yet) and the other ranks wait for (at most MOEGRAPH_EP_INIT_TIMEOUT_MS, default 120000).
 * Collective, as mg_ep_comm_create_nccl; a missing or malformed variable is MG_ERR_INVALID_ARGUMENT
 * naming it. */
MOEGRAPH_API mg_status mg_ep_comm_create_from_environment(mg_ep_comm** out);
/* The caller's NCCL communicator (an ncclComm_t passed as void*), with its current device current
 * (the communicator's). Not destroyed by moegraph: destroy it only after every mg_ep_comm made from
 * it and every layer and step made with those (their windows are deregistered on it). Collective
 * (every rank wraps its communicator, then creates the same layers and steps); the same checks as
 * mg_ep_comm_create_nccl. */
MOEGRAPH_API mg_status mg_ep_comm_wrap_nccl(void* nccl_comm, mg_ep_comm** out);
/* The ranks of the NCCL communicator `parent` that pass the same color (>= 0), ordered by key (then
 * by rank in parent), as a new communicator (ncclCommSplit): e.g. a sharded step under expert
 * parallelism takes the group of its data-parallel index and the group of its expert-parallel index
 * (docs/sharding.md). Collective over every rank of parent. An emulated parent is
 * MG_ERR_INVALID_ARGUMENT (make its groups directly with mg_ep_emulated_group_create). */
MOEGRAPH_API mg_status mg_ep_comm_split(mg_ep_comm* parent, int color, int key, mg_ep_comm** out);
/* `ranks` (1..64) emulated ranks in this process on the current device, for tests: out_array[r]
 * (the caller's array of `ranks` handles) is rank r, destroyed separately; on failure every entry
 * is NULL. Each rank's layer or step runs on its own stream, driven by its own host thread. With
 * more than one rank the process needs CUDA_MODULE_LOADING=EAGER (set before CUDA initializes:
 * a kernel loaded lazily mid-step would stall its waiting peers), and no more ranks than
 * CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 unless set before CUDA initializes, at most 32:
 * ranks sharing a queue could wait on each other), else MG_ERR_INVALID_ARGUMENT. The ranks'
 * layers may be created by one thread, one after the other; their steps not (mg_step_graphs_create
 * warms up with the other ranks): each on its rank's thread, with thread_local_capture. */
MOEGRAPH_API mg_status mg_ep_emulated_group_create(int ranks, mg_ep_comm** out_array);
/* NULL or a destroyed handle: nothing happens. Layers and steps made with it keep working. */
MOEGRAPH_API void mg_ep_comm_destroy(mg_ep_comm* comm);
/* This rank (0..ranks - 1) and the group's size. */
MOEGRAPH_API mg_status mg_ep_comm_rank(const mg_ep_comm* comm, int* out);
MOEGRAPH_API mg_status mg_ep_comm_ranks(const mg_ep_comm* comm, int* out);
/* A peer that died or hangs (moegraph::EpComm::wait and abort). A step reports it as
 * MG_ERR_DEVICE_SPLITS naming a peer timeout or a stopped peer (the device barriers gave up), or
 * the step never completes (a send/recv exchange's NCCL kernels wait without a timeout).
 * mg_ep_comm_wait waits on the host until the work enqueued on `stream` so far is done, at most
 * timeout_ms (>= 0; past a century, e.g. INT64_MAX for "forever", it waits a century): *completed
 * is 1, or 0 with the work still in flight; an error the transport reports (NCCL's asynchronous
 * error) is MG_ERR_LIBRARY. It polls, so another thread may abort meanwhile. mg_ep_comm_abort
 * stops the rank's communication for good: ncclCommAbort on a communicator moegraph created (NCCL
 * kernels waiting on a peer return), a mark only on a wrapped one (the caller aborts its own).
 * Afterwards every layer call and step with it is refused (MG_ERR_INVALID_ARGUMENT), and
 * destroying them, their windows and the handle waits for no peer. Not collective; safe from
 * another thread while the stream still runs a step; a second call does nothing. */
MOEGRAPH_API mg_status mg_ep_comm_wait(mg_ep_comm* comm, cudaStream_t stream, int64_t timeout_ms, int* completed);
MOEGRAPH_API mg_status mg_ep_comm_abort(mg_ep_comm* comm);

/* ---- Sharded weights (moegraph/sharding.hpp, docs/sharding.md): shard descriptors ---- */

/* MG_SHARD_CHUNK: ceil(R / W) rows per rank in rank order, the last ranks fewer or none (torch.chunk,
 * FSDP2). MG_SHARD_BALANCED: the first R mod W ranks floor(R / W) + 1 rows, the others floor(R / W). */
typedef enum { MG_SHARD_CHUNK = 0, MG_SHARD_BALANCED = 1, MG_SHARD_POLICY_FORCE_INT32 = 0x7fffffff,
               MG_SHARD_POLICY_FORCE_SIGNED = -0x7fffffff - 1 } mg_shard_policy;
/* What a row of a sharded weight is (config parallel.sharding.unit): an expert (dim 0 of [E, N, K], as
 * FSDP2's Shard(0)), or one of the E*N rows. */
typedef enum { MG_SHARD_UNIT_EXPERT = 0, MG_SHARD_UNIT_ROW = 1, MG_SHARD_UNIT_FORCE_INT32 = 0x7fffffff,
               MG_SHARD_UNIT_FORCE_SIGNED = -0x7fffffff - 1 } mg_shard_unit;
/* Rank `rank`'s rows [*first_row, *first_row + *rows) of a tensor of global_rows rows (1 to 2^62) over
 * `ranks` ranks (1 to 64). Touches no GPU. A refused call leaves both outputs 0. */
MOEGRAPH_API mg_status mg_shard_rows(mg_shard_policy policy, int64_t global_rows, int ranks, int rank,
                                     int64_t* first_row, int64_t* rows);

/* ---- MoE layer (moegraph::MoeLayer): router -> dispatch -> FC1 -> SwiGLU -> FC2 -> combine ---- */

typedef struct mg_moe_layer mg_moe_layer;

/* How expert-parallel ranks move rows: exact rows stored into the peers' windows (NCCL's device API),
 * or fixed chunks moved by grouped ncclSend / ncclRecv (sizes fixed at capture). */
typedef enum { MG_EP_PEER_STORES = 0, MG_EP_SEND_RECV = 1, MG_EP_EXCHANGE_FORCE_INT32 = 0x7fffffff,
               MG_EP_EXCHANGE_FORCE_SIGNED = -0x7fffffff - 1 } mg_ep_exchange;

typedef enum { MG_ROUTER_SOFTMAX = 0, MG_ROUTER_SIGMOID = 1, MG_ROUTER_FORCE_INT32 = 0x7fffffff,
               MG_ROUTER_FORCE_SIGNED = -0x7fffffff - 1 } mg_router_score;

/* Limits (MG_ERR_INVALID_ARGUMENT past them, and mg_last_error names the field, its value and the
 * limit): as commented per field; the permuted rows (max_tokens * top_k plus alignment padding)
 * below 2^31; rows * max(2 * ffn, hidden) * element size and experts * 2 * ffn * hidden * 4 at most 2^48 bytes,
 * and so the whole workspace. */
typedef struct {
  size_t struct_size;      /* sizeof(mg_moe_layer_options) */
  int experts;             /* E, 1..1024 */
  int64_t hidden;          /* multiple of 16, at most 2^20 */
  int64_t ffn;             /* multiple of 16, at most 2^20 */
  int top_k;               /* 1..8, at most experts */
  int bias;                /* bool: FC1 and FC2 biases */
  mg_router_score score;
  int renormalize;         /* bool: the chosen weights sum to 1 */
  double aux_loss_coef;    /* 0: no auxiliary loss */
  double capacity_factor;  /* 0: dropless; else at most ceil(cf * n * k / E) rows per expert */
  int fuse_weights;        /* bool: weights applied in the SwiGLU output instead of at the combine */
  int64_t max_tokens;      /* the bucket's capacity in tokens, 1..2^24 */
  int row_align;           /* 1, 16, 32, 128 */
  mg_dtype dtype;
  int training;            /* bool: reserve what forward with train != 0 and backward need */
  int wgrad_slots;         /* training forwards in flight at once, 1..64 */
  int delay_wgrad;         /* bool: backward queues the weight gradients for mg_moe_layer_backward_dw */
  int main_grad_fp32;      /* bool: weight gradients accumulate into fp32 main_grad_* (else d* written) */
  mg_recipe recipe;
  /* Expert parallelism (appended: a caller's older struct_size leaves both at their defaults). */
  int expert_parallel;     /* R, the ranks the experts are spread over: 1 (or 0) none, else 2..64 dividing
                              experts (mg_moe_layer_create_ep); max_tokens is per rank. Not yet with
                              capacity_factor or fuse_weights */
  int64_t ep_recv_rows;    /* rows of each rank's receive buffer: 0 for the worst case (every rank's
                              max_tokens * top_k rows to one rank, so none is ever dropped), else a
                              bound, a multiple of row_align (at or above the worst case: the worst case);
                              rows past it are dropped, counted on their source rank (read_dropped) and
                              contribute zero. 0 without expert parallelism */
  /* Appended after the expert-parallel fields (a caller's older struct_size leaves it at its default, 0). */
  int prequantized_weights; /* bool, MG_RECIPE_MXFP8 only: FC1 and FC2 read the caller's MXFP8 weights
                               (mg_moe_layer_weights w1_mxfp8_*, w2_mxfp8_*); w1 and w2 may be NULL */
  /* Appended after prequantized_weights (an older struct_size leaves both at 0: peer stores). */
  mg_ep_exchange ep_exchange; /* how rows move between ranks; MG_EP_SEND_RECV needs expert_parallel > 1 */
  int64_t ep_chunk_rows;    /* MG_EP_SEND_RECV: rows each rank sends each rank per exchange (fixed chunks);
                               0 for the worst case max_tokens * top_k; rows past it are dropped and counted */
  /* Appended after ep_chunk_rows (an older struct_size leaves it at 0). */
  int dequantized_weights;  /* bool, MG_RECIPE_MXFP8 with bf16 only: FC1's and FC2's MXFP8 weights also
                               kept dequantized to bf16 (mg_grouped_linear_options says more); with
                               prequantized_weights the caller's (w1_mxfp8_dequantized, ...) */
} mg_moe_layer_options;

/* Parameters and their gradients (device). The gradient set follows main_grad_fp32; biases only
 * with options.bias. With expert parallelism E is this rank's experts (options.experts /
 * expert_parallel) in every expert tensor and gradient; the router and its gradient stay [experts,
 * hidden]. */
typedef struct {
  size_t struct_size;  /* sizeof(mg_moe_layer_weights) */
  const void* router;  /* [E, hidden] */
  const void* w1;      /* [E, 2 * ffn, hidden]  (gate | up) */
  const void* b1;      /* [E, 2 * ffn] */
  const void* w2;      /* [E, hidden, ffn] */
  const void* b2;      /* [E, hidden] */
  float* main_grad_router;
  float* main_grad1;
  float* main_grad2;
  void* d_router;
  void* dw1;
  void* dw2;
  void* db1;
  void* db2;
  /* Appended (an older struct_size means NULL): with options.prequantized_weights, w1 and w2 as MXFP8
     (see MXFP8 weights): data and scales always, data_t and scales_t for training */
  const uint8_t* w1_mxfp8_data;     /* [E, 2 * ffn, hidden] */
  const uint8_t* w1_mxfp8_scales;   /* [E, 2 * ffn, hidden / 32] */
  const uint8_t* w1_mxfp8_data_t;   /* [E, hidden, 2 * ffn] */
  const uint8_t* w1_mxfp8_scales_t; /* [E, hidden, 2 * ffn / 32] */
  const uint8_t* w2_mxfp8_data;     /* [E, hidden, ffn] */
  const uint8_t* w2_mxfp8_scales;   /* [E, hidden, ffn / 32] */
  const uint8_t* w2_mxfp8_data_t;   /* [E, ffn, hidden] */
  const uint8_t* w2_mxfp8_scales_t; /* [E, ffn, hidden / 32] */
  /* Appended (an older struct_size means NULL): with prequantized_weights and dequantized_weights,
     their bf16 values (mg_dequantize_mxfp8_weights); the _t ones for training */
  const void* w1_mxfp8_dequantized;   /* [E, 2 * ffn, hidden] */
  const void* w1_mxfp8_dequantized_t; /* [E, hidden, 2 * ffn] */
  const void* w2_mxfp8_dequantized;   /* [E, hidden, ffn] */
  const void* w2_mxfp8_dequantized_t; /* [E, ffn, hidden] */
  /* Appended (an older struct_size means NULL): optional with prequantized_weights, the tiled
     copies of the scales above (mg_tile_mxfp8_weight_scales); the _t ones for training */
  const uint8_t* w1_mxfp8_scales_tiled;
  const uint8_t* w1_mxfp8_scales_t_tiled;
  const uint8_t* w2_mxfp8_scales_tiled;
  const uint8_t* w2_mxfp8_scales_t_tiled;
} mg_moe_layer_weights;

/* One step's activations (device). Rows at or past *num_tokens are neither read nor written,
 * except dx, whose rows [n, max_tokens) are written as zero: x, y and dy may be buffers of just n
 * rows (a graph replayed for several n needs max_tokens), dx must hold max_tokens rows. */
typedef struct {
  size_t struct_size;         /* sizeof(mg_moe_layer_io) */
  const void* x;              /* [max_tokens, hidden] */
  const int32_t* num_tokens;  /* device scalar n, 0 <= n <= max_tokens */
  void* y;                    /* [max_tokens, hidden] */
  float* aux_loss;            /* device scalar; may be NULL when aux_loss_coef == 0 */
  const void* dy;             /* backward: [max_tokens, hidden] */
  void* dx;                   /* backward: [max_tokens, hidden] */
} mg_moe_layer_io;

/* Fills *options with the defaults (struct_size set; top_k 1, softmax, no renormalization, no aux
 * loss, dropless, row_align 1, bf16, training, one slot, no delay, fp32 main_grad, no expert
 * parallelism: expert_parallel 1, ep_recv_rows 0; not prequantized); experts, hidden, ffn and
 * max_tokens are 0 and must be set. As mg_grouped_linear_options_init: the macro passes the
 * header's sizeof to mg_moe_layer_options_init_sized, which writes no more than that. */
MOEGRAPH_API void mg_moe_layer_options_init(mg_moe_layer_options* options);
MOEGRAPH_API mg_status mg_moe_layer_options_init_sized(mg_moe_layer_options* options, size_t struct_size);
#define mg_moe_layer_options_init(options) mg_moe_layer_options_init_sized((options), sizeof *(options))
/* Validates the options and gives the workspace size (at most 2^48 bytes). Touches no GPU. On
 * failure *out is 0 and mg_last_error names the field, its value and the limit. */
MOEGRAPH_API mg_status mg_moe_layer_workspace_bytes(const mg_moe_layer_options* options, size_t* out);
/* Expert parallelism: the bytes of the window each rank allocates on its communicator when the
 * layer is created (outside the workspace), 0 without expert parallelism. Validates as
 * mg_moe_layer_workspace_bytes; touches no GPU. */
MOEGRAPH_API mg_status mg_moe_layer_window_bytes(const mg_moe_layer_options* options, size_t* out);
/* workspace: device memory of mg_moe_layer_workspace_bytes(options) bytes, 256-byte aligned, or NULL
 * to have the layer allocate its own. The weights' pointers are kept, not copied. Before capture.
 * Refuses expert_parallel > 1 (use mg_moe_layer_create_ep), and NULL weights the layer will read
 * (router, w1 and w2 or their MXFP8 tensors, for training also the transposed ones dgrad reads, b1
 * and b2 with bias: MG_ERR_INVALID_ARGUMENT, before the device is touched). The gradient buffers
 * are checked by each backward, before it enqueues anything, as is every pointer of
 * mg_moe_layer_io a call needs; with the mxfp8 recipe from the layer's own copies, a forward
 * before the first mg_moe_layer_weights_changed is refused the same way. */
MOEGRAPH_API mg_status mg_moe_layer_create(const mg_moe_layer_options* options, const mg_moe_layer_weights* weights,
                                           void* workspace, mg_moe_layer** out);
/* mg_moe_layer_create for one rank of an expert-parallel group: `comm` is this rank's communicator
 * of options->expert_parallel ranks (it may be NULL only when expert_parallel is 1), the expert
 * tensors of `weights` are this rank's E/R experts. Collective (see Expert parallelism): every rank
 * creates its layer with the same options in the same order; the layer allocates its window
 * (mg_moe_layer_window_bytes) on the communicator, which may synchronize the device, and keeps
 * the communicator alive. The options and the communicator are checked before any CUDA call. */
MOEGRAPH_API mg_status mg_moe_layer_create_ep(const mg_moe_layer_options* options, const mg_moe_layer_weights* weights,
                                              void* workspace, mg_ep_comm* comm, mg_moe_layer** out);
/* NULL or a destroyed handle: nothing happens. */
MOEGRAPH_API void mg_moe_layer_destroy(mg_moe_layer* layer);
/* train != 0 saves the context for backward into the next free slot (forward_train). */
MOEGRAPH_API mg_status mg_moe_layer_forward(mg_moe_layer* layer, const mg_moe_layer_io* io, int train,
                                            cudaStream_t stream);
/* Backward of the oldest training forward; weight gradients at once or queued (options.delay_wgrad). */
MOEGRAPH_API mg_status mg_moe_layer_backward(mg_moe_layer* layer, const mg_moe_layer_io* io, cudaStream_t stream);
MOEGRAPH_API mg_status mg_moe_layer_backward_dw(mg_moe_layer* layer, cudaStream_t stream);
/* The weights changed: the MXFP8 recipe re-quantizes its copies (nothing for bf16, or with
 * prequantized_weights: the caller keeps its MXFP8 weights current). Enqueued. */
MOEGRAPH_API mg_status mg_moe_layer_weights_changed(mg_moe_layer* layer, cudaStream_t stream);
/* The weights and gradient buffers moved (a framework re-gathered its parameters at a new address,
 * say): later calls read and write `weights`. Host only, nothing enqueued; saved micro-batches stay
 * valid (their backward reads the new weights, which must hold the same values). The same weights
 * must be set as at creation (gradient buffers may change); while delayed weight gradients are
 * queued, the buffers they write (main_grad*, d_router, dw1, dw2) may not move. */
MOEGRAPH_API mg_status mg_moe_layer_set_weights(mg_moe_layer* layer, const mg_moe_layer_weights* weights);
/* Synchronizes the stream; *out = this rank's (token, expert) assignments dropped by the capacity
 * factor or by a receive bound (ep_recv_rows) since the last call (the counter is reset); 0 when
 * dropless. */
MOEGRAPH_API mg_status mg_moe_layer_read_dropped(mg_moe_layer* layer, cudaStream_t stream, uint64_t* out);
/* Synchronizes the stream; MG_ERR_DEVICE_SPLITS if an invalid token count or invalid splits were
 * seen since the last check. */
MOEGRAPH_API mg_status mg_moe_layer_check_device_errors(mg_moe_layer* layer, cudaStream_t stream);

/* ---- Configs (moegraph::Config): a parsed, validated JSON config (docs/config.md) ---- */

typedef struct mg_config mg_config;

/* Reads and validates a config file / JSON text. MG_ERR_CONFIG with the key, value and rule (or the
 * line and column of malformed JSON, or the file and the OS reason) in mg_last_error. Touches no GPU. */
MOEGRAPH_API mg_status mg_config_load(const char* path, mg_config** out);
MOEGRAPH_API mg_status mg_config_parse(const char* json_text, mg_config** out);
/* The built-in default config (the Qwen3-30B-A3B-like preset). */
MOEGRAPH_API mg_status mg_config_default(mg_config** out);
MOEGRAPH_API void mg_config_destroy(mg_config* config);

/* What a caller needs to allocate a config's weights: [experts, hidden] router, [experts, 2 * ffn,
 * hidden] w1, [experts, hidden, ffn] w2 (biases [experts, 2 * ffn] and [experts, hidden] with bias),
 * in dtype (w1 and w2 as MXFP8 with prequantized_weights); gradients as the training fields say.
 * With expert_parallel R > 1 every rank holds experts / R of them in w1, w2, the biases and their
 * gradients (the router stays whole). */
typedef struct {
  size_t struct_size;  /* sizeof(mg_config_shape) */
  int whole_layer;     /* 1: the MoE layer (x, num_tokens -> y); 0: the expert MLP on grouped rows (x, splits -> y) */
  int experts;
  int64_t hidden;
  int64_t ffn;
  int top_k;
  int bias;
  mg_dtype dtype;
  mg_recipe recipe;
  int training;        /* training phases are captured */
  int delay_wgrad;
  int main_grad_fp32;  /* gradients accumulate into fp32 main_grad_* (else d* are written) */
  int num_buckets;
  int64_t max_tokens;  /* the largest bucket's capacity (per rank with expert parallelism) */
  int expert_parallel; /* parallel.expert_parallel: R ranks (1: none). Appended: an older struct_size leaves it unwritten */
  /* precision.prequantized_weights (bool): w1 and w2 go to mg_step_weights as MXFP8 (w1_mxfp8_*,
     w2_mxfp8_*; see MXFP8 weights), not in dtype. Appended after expert_parallel: a struct_size ending
     before it leaves it unwritten (the previous release's sizeof takes it in its tail padding) */
  int prequantized_weights;
  /* precision.dequantized_weights (bool): with prequantized_weights, mg_step_weights also carries the
     bf16 values (w1_mxfp8_dequantized, ...). Appended after prequantized_weights */
  int dequantized_weights;
  /* parallel.sharding (docs/sharding.md), what sizes this rank's shards in mg_step_weights:
     mg_shard_rows(shard_policy, rows, shard_ranks, rank, ...) with rows the experts (per rank with
     expert parallelism) for MG_SHARD_UNIT_EXPERT, or those experts times a weight's N for
     MG_SHARD_UNIT_ROW. Appended after dequantized_weights; 64-bit so that it begins past the
     previous release's tail padding. shard_ranks 1: not sharded; 0: a library older than these
     fields filled the struct (not sharded either) */
  int64_t shard_ranks;
  mg_shard_policy shard_policy;
  mg_shard_unit shard_unit;
} mg_config_shape;

/* Fills *out (the caller sets out->struct_size). */
MOEGRAPH_API mg_status mg_config_shape_of(const mg_config* config, mg_config_shape* out);
/* Overrides before mg_step_graphs_create: training 0 captures the forward phase only (a server), and
 * turns delay_wgrad off until training 1 restores it. The config's rules are checked again: a config
 * that cannot train (the mxfp8 recipe at row_align 1 or 16) refuses training 1 with MG_ERR_CONFIG
 * and stays as it was. */
MOEGRAPH_API mg_status mg_config_set_training(mg_config* config, int training);

/* ---- Capture and replay (moegraph::StepGraphs): one step per shape bucket, in CUDA graphs ---- */

typedef struct mg_step_graphs mg_step_graphs;

typedef enum {
  MG_PHASE_FORWARD = 0,       /* inference: saves nothing */
  MG_PHASE_FORWARD_TRAIN = 1, /* saves the context for backward */
  MG_PHASE_BACKWARD = 2,
  MG_PHASE_WGRAD = 3,         /* the delayed weight gradients (training.delay_wgrad) */
  MG_PHASE_FORCE_INT32 = 0x7fffffff,
  MG_PHASE_FORCE_SIGNED = -0x7fffffff - 1
} mg_phase;

/* Caller-owned device parameters and gradients, shared by every bucket (moegraph::StepWeights): the
 * router for the whole layer, w1 and w2 (or their MXFP8 copies with precision.prequantized_weights),
 * biases with bias, and with training either fp32 main_grad_* or d*. They must stay valid until
 * mg_step_graphs_destroy. */
typedef struct {
  size_t struct_size;  /* sizeof(mg_step_weights) */
  void* router;
  float* main_grad_router;
  void* d_router;
  void* w1;
  void* w2;
  void* b1;
  void* b2;
  float* main_grad1;
  float* main_grad2;
  void* dw1;
  void* dw2;
  void* db1;
  void* db2;
  /* Appended (an older struct_size means NULL): with precision.prequantized_weights (recipe mxfp8), w1
     and w2 as MXFP8 instead (see MXFP8 weights; shapes as in mg_moe_layer_weights): data and scales
     always, data_t and scales_t for training. Without it a step of the mxfp8 recipe quantizes w1 and
     w2 itself into one set of copies that every bucket reads. */
  uint8_t* w1_mxfp8_data;
  uint8_t* w1_mxfp8_scales;
  uint8_t* w1_mxfp8_data_t;
  uint8_t* w1_mxfp8_scales_t;
  uint8_t* w2_mxfp8_data;
  uint8_t* w2_mxfp8_scales;
  uint8_t* w2_mxfp8_data_t;
  uint8_t* w2_mxfp8_scales_t;
  /* Appended (an older struct_size means NULL): with precision.prequantized_weights and
     precision.dequantized_weights, their bf16 values (mg_dequantize_mxfp8_weights); the _t ones for
     training. Without prequantized_weights the step keeps them itself. */
  void* w1_mxfp8_dequantized;
  void* w1_mxfp8_dequantized_t;
  void* w2_mxfp8_dequantized;
  void* w2_mxfp8_dequantized_t;
  /* Appended (an older struct_size means NULL): optional with precision.prequantized_weights, the
     tiled copies of the scales above (mg_tile_mxfp8_weight_scales); the _t ones for training.
     Without prequantized_weights the step keeps them itself. */
  uint8_t* w1_mxfp8_scales_tiled;
  uint8_t* w1_mxfp8_scales_t_tiled;
  uint8_t* w2_mxfp8_scales_tiled;
  uint8_t* w2_mxfp8_scales_t_tiled;
} mg_step_weights;

typedef struct {
  size_t struct_size;        /* sizeof(mg_step_graphs_options) */
  /* 0: capture in cudaStreamCaptureModeGlobal, which proves that no enqueue path synchronizes or
   * allocates anywhere in the process but forbids other threads to do either meanwhile; 1: capture
   * thread-locally, so other threads may set up and synchronize while this one creates. Emulated
   * expert-parallel ranks in one process need 1 (another rank's thread sets up meanwhile). */
  int thread_local_capture;
  /* Expert parallelism (appended: an older struct_size means NULL): this rank's communicator, of the
   * config's parallel.expert_parallel ranks; NULL when that is 1. The step keeps it alive. */
  mg_ep_comm* comm;
  /* Sharded weights (appended: an older struct_size means NULL): this rank's communicator of the
   * data-parallel group of the config's parallel.sharding.ranks = W ranks; NULL when W is 1. Then
   * mg_step_weights' w1, w2, b1, b2 and their gradients are this rank's shards (of its own experts
   * with expert parallelism) under the config's policy and unit (mg_shard_rows; NULL for a rank
   * holding no rows); docs/sharding.md. With both, `comm` joins the ranks of this rank's
   * data-parallel index and `shard_comm` those of its expert-parallel index (mg_ep_comm_split). */
  mg_ep_comm* shard_comm;
} mg_step_graphs_options;

/* A bucket's device buffers (moegraph::BucketIO). Whole layer: write x [tokens, hidden] and
 * *num_tokens (and dy), read y, aux_loss (and dx). Experts only: write x [rows, hidden] grouped by
 * expert and splits (and dy), read y (and dx); rows of y and dx past the last group are not
 * written (they hold whatever the buffer held). */
typedef struct {
  size_t struct_size;   /* sizeof(mg_bucket_io) */
  int64_t tokens;       /* capacity in tokens */
  int64_t rows;         /* the experts' rows: tokens * top_k plus alignment padding, or with expert
                           parallelism the receive rows of this rank's experts */
  void* x;
  int32_t* splits;      /* experts only: [experts] */
  int32_t* num_tokens;  /* whole layer: device scalar, 0..tokens */
  float* aux_loss;      /* whole layer with an aux loss: device scalar */
  void* y;
  void* dy;
  void* dx;
} mg_bucket_io;

/* Allocates the arena, binds the weights, warms up and captures every bucket's phases (host work;
 * MXFP8 from 16-bit weights: call mg_step_graphs_weights_changed once they are written). The
 * warm-up of a training step writes the gradient buffers before this returns: zeros into the 16-bit
 * ones (dw1, dw2, d_router; db1, db2 with main_grad too), zero added to main_grad_router. options
 * may be NULL.
 * The step keeps no reference to `config`: it may be destroyed right after.
 * Expert parallelism (the config's parallel.expert_parallel R > 1): options->comm is this rank's
 * communicator of R ranks and the weights are this rank's experts (mg_config_shape). Collective:
 * every rank creates the same step (each bucket allocates its window on the communicator and warms
 * up with the other ranks), then every rank replays the same phases of the same buckets: pick the
 * bucket for the largest token count over the ranks (each rank's own count may be smaller). */
MOEGRAPH_API mg_status mg_step_graphs_create(const mg_config* config, const mg_step_weights* weights,
                                             const mg_step_graphs_options* options, mg_step_graphs** out);
/* NULL or a destroyed handle: nothing happens. */
MOEGRAPH_API void mg_step_graphs_destroy(mg_step_graphs* step);
/* The number of buckets (0 on a refused call). */
MOEGRAPH_API mg_status mg_step_graphs_num_buckets(const mg_step_graphs* step, int* out);
/* The bucket's capacity in tokens; MG_ERR_INVALID_ARGUMENT for a bucket outside 0..num_buckets - 1
 * (and *out 0). */
MOEGRAPH_API mg_status mg_step_graphs_bucket_tokens(const mg_step_graphs* step, int bucket, int64_t* out);
/* The smallest bucket holding `tokens` (0..the largest capacity; 0 gives the first bucket);
 * MG_ERR_INVALID_ARGUMENT for a negative count or one above the largest capacity. */
MOEGRAPH_API mg_status mg_step_graphs_bucket_for(const mg_step_graphs* step, int64_t tokens, int* out);
/* Fills *out (the caller sets out->struct_size). */
MOEGRAPH_API mg_status mg_step_graphs_io(const mg_step_graphs* step, int bucket, mg_bucket_io* out);
/* Replays the bucket's graph of `phase` on `stream`. Buckets share one arena: while one bucket has
 * training contexts in flight (forward_train awaiting backward, or queued wgrads), every inference
 * forward (MG_PHASE_FORWARD, of any bucket, the same one included) and another bucket's training
 * phases are refused. */
MOEGRAPH_API mg_status mg_step_graphs_replay(mg_step_graphs* step, int bucket, mg_phase phase, cudaStream_t stream);
/* The same phase enqueued without graphs (same rules), for checks and timing. Micro-batches in
 * flight finish the way their forward_train ran: replayed ones by replays, eager ones eagerly (a
 * mix is refused, MG_ERR_INVALID_ARGUMENT). */
MOEGRAPH_API mg_status mg_step_graphs_run_eager(mg_step_graphs* step, int bucket, mg_phase phase, cudaStream_t stream);
/* The weights were updated: MXFP8 re-quantizes w1 and w2 into the copies every bucket shares;
 * nothing for bf16, with prequantized_weights (the caller keeps them current) or with sharded
 * weights (each forward quantizes what it gathers). Enqueued. */
MOEGRAPH_API mg_status mg_step_graphs_weights_changed(mg_step_graphs* step, cudaStream_t stream);
/* Synchronizes the stream; MG_ERR_DEVICE_SPLITS if any bucket saw invalid device inputs (a token
 * count over the bucket's capacity, invalid splits) since the last check. */
MOEGRAPH_API mg_status mg_step_graphs_check_device_errors(mg_step_graphs* step, cudaStream_t stream);
/* Synchronizes the stream; *out = this rank's assignments dropped by the capacity factor or by a
 * receive bound (parallel.recv_rows) since the last call. */
MOEGRAPH_API mg_status mg_step_graphs_read_dropped(mg_step_graphs* step, cudaStream_t stream, uint64_t* out);

#ifdef __cplusplus
}
#endif

#endif /* MOEGRAPH_MOEGRAPH_H_ */
