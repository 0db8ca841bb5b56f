/* moegraph C ABI: a thin layer over moegraph::GroupedLinear. No exception crosses it: every call
 * returns a status, and mg_last_error() gives the message of this thread's last failure. Enqueue
 * calls (forward, backward, backward_dw) are graph-capturable, as in the C++ API. */
#ifndef MOEGRAPH_MOEGRAPH_H_
#define MOEGRAPH_MOEGRAPH_H_

#include <cuda_runtime_api.h>
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
  MG_ERR_INTERNAL = 5
} mg_status;

typedef enum { MG_DTYPE_BF16 = 0, MG_DTYPE_FP16 = 1 } mg_dtype;

typedef struct mg_grouped_linear mg_grouped_linear;

typedef struct {
  int num_groups;
  int64_t in_features;   /* K */
  int64_t out_features;  /* N */
  int64_t capacity_rows;
  int row_align;         /* 1, 16, 32, 128 */
  mg_dtype dtype;
  int bias;              /* bool */
  int wgrad_slots;
  int delay_wgrad;       /* bool */
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
mg_status mg_grouped_linear_create(const mg_grouped_linear_options* options, mg_grouped_linear** out);
void mg_grouped_linear_destroy(mg_grouped_linear* op);
/* train != 0 saves the context for backward (forward_train). */
mg_status mg_grouped_linear_forward(mg_grouped_linear* op, const mg_forward_args* args, int train, cudaStream_t stream);
/* delay_wgrad != 0 queues the weight gradient for mg_grouped_linear_backward_dw. */
mg_status mg_grouped_linear_backward(mg_grouped_linear* op, const mg_backward_args* args, int delay_wgrad,
                                     cudaStream_t stream);
mg_status mg_grouped_linear_backward_dw(mg_grouped_linear* op, cudaStream_t stream);
/* Synchronizes the stream; MG_ERR_DEVICE_SPLITS if invalid splits were seen since the last check. */
mg_status mg_grouped_linear_check_device_errors(mg_grouped_linear* op, cudaStream_t stream);

const char* mg_last_error(void);
int mg_nccl_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MOEGRAPH_MOEGRAPH_H_ */
