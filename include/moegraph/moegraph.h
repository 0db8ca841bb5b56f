/* moegraph C ABI: a thin layer over moegraph::GroupedLinear (mg_grouped_linear_*) and
 * moegraph::MoeLayer (mg_moe_layer_*). No exception crosses it: every call returns a status, and
 * mg_last_error() gives the message of this thread's last failure. Enqueue calls (forward, backward,
 * backward_dw) are graph-capturable, as in the C++ API; create, read_dropped and
 * check_device_errors are not (they may allocate or synchronize). Threading: a handle is used by one
 * thread at a time and is bound to the device current at create; distinct handles may run on
 * distinct threads (the whole contract is in moegraph/step_graphs.hpp). */
#ifndef MOEGRAPH_MOEGRAPH_H_
#define MOEGRAPH_MOEGRAPH_H_

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MG_OK = 0,
  MG_ERR_INVALID_ARGUMENT = 1, /* bad options or arguments; nothing was enqueued */
  MG_ERR_CUDA = 2,             /* a CUDA runtime call failed */
  MG_ERR_LIBRARY = 3,          /* cuBLASLt or NCCL failed */
  MG_ERR_DEVICE_SPLITS = 4,    /* the device raised an invalid-splits error (check_device_errors) */
  MG_ERR_INTERNAL = 5,
  MG_ERR_NO_DEVICE = 6,          /* no usable CUDA device */
  MG_ERR_UNSUPPORTED_DEVICE = 7  /* the device is not compute capability 9.0 (Hopper) */
} mg_status;

/* Each enum spans every int32 (the *_FORCE_* values), so any int a caller stores in an enum field
   is a value of the type, refused by name, never undefined behaviour. */
typedef enum { MG_DTYPE_BF16 = 0, MG_DTYPE_FP16 = 1, MG_DTYPE_FORCE_INT32 = 0x7fffffff,
               MG_DTYPE_FORCE_SIGNED = -0x7fffffff - 1 } mg_dtype;
/* MG_RECIPE_MXFP8: the GEMMs run on MXFP8 copies (K, N multiples of 128, row_align 32 or 128);
 * quantize the weights with mg_grouped_linear_weights_changed / mg_moe_layer_weights_changed
 * before the first forward and after every weight update. */
typedef enum { MG_RECIPE_BF16 = 0, MG_RECIPE_MXFP8 = 1, MG_RECIPE_FORCE_INT32 = 0x7fffffff,
               MG_RECIPE_FORCE_SIGNED = -0x7fffffff - 1 } mg_recipe;

typedef struct mg_grouped_linear mg_grouped_linear;

/* Limits (moegraph::validate refuses past them with MG_ERR_INVALID_ARGUMENT, and mg_last_error names
 * the field, its value and the limit): num_groups 1..1024; in_features and out_features multiples
 * of 16, at most 2^21; capacity_rows 1..2^31 - 1; capacity_rows * max(K, N) * element size and
 * num_groups * N * K * 4 at most 2^48 bytes, and so the whole workspace. */
typedef struct {
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
} mg_grouped_linear_options;

typedef struct {
  const void* x;
  const int32_t* splits;
  const void* weight;
  const void* bias;
  const float* bias_scale;
  void* y;
} mg_forward_args;

typedef struct {
  const void* dy;
  const void* weight;
  const void* bias;
  void* dx;
  void* dbias;
  float* dbias_scale;
  void* dweight;
  float* main_grad;
} mg_backward_args;

/* Fills *options with the defaults (row_align 1, bf16, no bias, one slot, no delay). */
void mg_grouped_linear_options_init(mg_grouped_linear_options* options);
/* Validates the options and sizes the workspace (MG_ERR_INVALID_ARGUMENT past the limits above)
 * before any CUDA call, then allocates it. */
mg_status mg_grouped_linear_create(const mg_grouped_linear_options* options, mg_grouped_linear** out);
void mg_grouped_linear_destroy(mg_grouped_linear* op);
/* train != 0 saves the context for backward (forward_train). */
mg_status mg_grouped_linear_forward(mg_grouped_linear* op, const mg_forward_args* args, int train, cudaStream_t stream);
/* delay_wgrad != 0 queues the weight gradient for mg_grouped_linear_backward_dw. */
mg_status mg_grouped_linear_backward(mg_grouped_linear* op, const mg_backward_args* args, int delay_wgrad,
                                     cudaStream_t stream);
mg_status mg_grouped_linear_backward_dw(mg_grouped_linear* op, cudaStream_t stream);
/* The weights [G, N, K] changed: MXFP8 re-quantizes its copies, bf16 has nothing to do (enqueued,
   capturable). Call it before the first forward and after every update. */
mg_status mg_grouped_linear_weights_changed(mg_grouped_linear* op, const void* weight, cudaStream_t stream);
/* Synchronizes the stream; MG_ERR_DEVICE_SPLITS if invalid splits were seen since the last check. */
mg_status mg_grouped_linear_check_device_errors(mg_grouped_linear* op, cudaStream_t stream);

/* ---- MoE layer (moegraph::MoeLayer): router -> dispatch -> FC1 -> SwiGLU -> FC2 -> combine ---- */

typedef struct mg_moe_layer mg_moe_layer;

typedef enum { MG_ROUTER_SOFTMAX = 0, MG_ROUTER_SIGMOID = 1, MG_ROUTER_FORCE_INT32 = 0x7fffffff,
               MG_ROUTER_FORCE_SIGNED = -0x7fffffff - 1 } mg_router_score;

/* Limits (MG_ERR_INVALID_ARGUMENT past them, and mg_last_error names the field, its value and the
 * limit): as commented per field; the permuted rows (max_tokens * top_k plus alignment padding)
 * below 2^31; rows * 2 * ffn * element size and experts * 2 * ffn * hidden * 4 at most 2^48 bytes,
 * and so the whole workspace. */
typedef struct {
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
} mg_moe_layer_options;

/* Parameters and their gradients (device). The gradient set follows main_grad_fp32; biases only
 * with options.bias. */
typedef struct {
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
} mg_moe_layer_weights;

/* One step's activations (device). Rows at or past *num_tokens are neither read nor written,
 * except dx, whose rows [n, max_tokens) are written as zero. */
typedef struct {
  const void* x;              /* [max_tokens, hidden] */
  const int32_t* num_tokens;  /* device scalar n, 0 <= n <= max_tokens */
  void* y;                    /* [max_tokens, hidden] */
  float* aux_loss;            /* device scalar; may be NULL when aux_loss_coef == 0 */
  const void* dy;             /* backward: [max_tokens, hidden] */
  void* dx;                   /* backward: [max_tokens, hidden] */
} mg_moe_layer_io;

/* Fills *options with the defaults (top_k 1, softmax, no renormalization, no aux loss, dropless,
 * row_align 1, bf16, training, one slot, no delay, fp32 main_grad); experts, hidden, ffn and
 * max_tokens are 0 and must be set. */
void mg_moe_layer_options_init(mg_moe_layer_options* options);
/* workspace: device memory of mg_moe_layer_workspace_bytes(options) bytes, 256-byte aligned, or NULL
 * to have the layer allocate its own. The weights' pointers are kept, not copied. Before capture. */
mg_status mg_moe_layer_create(const mg_moe_layer_options* options, const mg_moe_layer_weights* weights,
                              void* workspace, mg_moe_layer** out);
/* Validates the options and gives the workspace size (at most 2^48 bytes). Touches no GPU. On
 * failure *out is 0 and mg_last_error names the field, its value and the limit. */
mg_status mg_moe_layer_workspace_bytes(const mg_moe_layer_options* options, size_t* out);
void mg_moe_layer_destroy(mg_moe_layer* layer);
/* train != 0 saves the context for backward into the next free slot (forward_train). */
mg_status mg_moe_layer_forward(mg_moe_layer* layer, const mg_moe_layer_io* io, int train, cudaStream_t stream);
/* Backward of the oldest training forward; weight gradients at once or queued (options.delay_wgrad). */
mg_status mg_moe_layer_backward(mg_moe_layer* layer, const mg_moe_layer_io* io, cudaStream_t stream);
mg_status mg_moe_layer_backward_dw(mg_moe_layer* layer, cudaStream_t stream);
/* The weights changed: the MXFP8 recipe re-quantizes its copies (nothing for bf16). Enqueued. */
mg_status mg_moe_layer_weights_changed(mg_moe_layer* layer, cudaStream_t stream);
/* Synchronizes the stream; *out = the (token, expert) assignments dropped by the capacity factor
 * since the last call (the counter is reset); 0 when dropless. */
mg_status mg_moe_layer_read_dropped(mg_moe_layer* layer, cudaStream_t stream, uint64_t* out);
/* Synchronizes the stream; MG_ERR_DEVICE_SPLITS if an invalid token count or invalid splits were
 * seen since the last check. */
mg_status mg_moe_layer_check_device_errors(mg_moe_layer* layer, cudaStream_t stream);

/* ---- common ---- */

const char* mg_last_error(void);
int mg_nccl_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MOEGRAPH_MOEGRAPH_H_ */
