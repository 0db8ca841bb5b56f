/* A C program built against an installed moegraph with pkg-config alone (tests/package/install_test).
 * Without a GPU it runs the calls that need none and exits 77; with one it runs a grouped linear on
 * caller-owned workspace and checks y = x W^T per group against a double-precision product. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moegraph/moegraph.h>

#define G 2
#define K 32
#define N 16
#define ROWS 16

static int fail(const char* what, mg_status s) {
  fprintf(stderr, "c-consumer: %s: %s: %s\n", what, mg_status_string(s), mg_last_error());
  return 1;
}

/* float -> bf16 bits, round to nearest even (finite inputs). */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static double from_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

int main(void) {
  if (mg_version() / 10000 != MOEGRAPH_VERSION_MAJOR) {
    fprintf(stderr, "c-consumer: library version %d, headers %s\n", mg_version(), MOEGRAPH_VERSION_STRING);
    return 1;
  }
  mg_config* config = NULL;
  mg_status s = mg_config_default(&config);
  if (s != MG_OK) return fail("mg_config_default", s);
  mg_config_shape shape = {0};
  shape.struct_size = sizeof(shape);
  if ((s = mg_config_shape_of(config, &shape)) != MG_OK) return fail("mg_config_shape_of", s);
  mg_config_destroy(config);

  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = G, o.in_features = K, o.out_features = N, o.capacity_rows = ROWS;
  size_t bytes = 0;
  if ((s = mg_grouped_linear_workspace_bytes(&o, &bytes)) != MG_OK) return fail("workspace_bytes", s);
  printf("c-consumer: moegraph %s, default config %d experts x %lld hidden, workspace %zu bytes\n",
         MOEGRAPH_VERSION_STRING, shape.experts, (long long)shape.hidden, bytes);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("c-consumer: no GPU, stopping before the device calls\n");
    return 77;
  }
  void* workspace = NULL;
  if (cudaMalloc(&workspace, bytes) != cudaSuccess) return fail("cudaMalloc", MG_ERR_CUDA);
  mg_grouped_linear* op = NULL;
  if ((s = mg_grouped_linear_create(&o, workspace, &op)) != MG_OK) return fail("mg_grouped_linear_create", s);

  const int32_t splits[G] = {5, 11};
  uint16_t x[ROWS * K], w[G * N * K], y[ROWS * N];
  srand(7);
  for (int i = 0; i < ROWS * K; ++i) x[i] = to_bf16((float)rand() / RAND_MAX * 2.0f - 1.0f);
  for (int i = 0; i < G * N * K; ++i) w[i] = to_bf16(((float)rand() / RAND_MAX * 2.0f - 1.0f) * 0.2f);
  memset(y, 0xff, sizeof(y)); /* NaN: unwritten rows fail */
  void *dx, *dw, *dy, *dsplits;
  cudaMalloc(&dx, sizeof(x)), cudaMalloc(&dw, sizeof(w)), cudaMalloc(&dy, sizeof(y)), cudaMalloc(&dsplits, sizeof(splits));
  cudaMemcpy(dx, x, sizeof(x), cudaMemcpyHostToDevice);
  cudaMemcpy(dw, w, sizeof(w), cudaMemcpyHostToDevice);
  cudaMemcpy(dy, y, sizeof(y), cudaMemcpyHostToDevice);
  cudaMemcpy(dsplits, splits, sizeof(splits), cudaMemcpyHostToDevice);
  mg_forward_args a = {0};
  a.struct_size = sizeof(a);
  a.x = dx, a.splits = dsplits, a.weight = dw, a.y = dy;
  if ((s = mg_grouped_linear_forward(op, &a, 0, NULL)) != MG_OK) return fail("forward", s);
  if ((s = mg_grouped_linear_check_device_errors(op, NULL)) != MG_OK) return fail("check_device_errors", s);
  cudaMemcpy(y, dy, sizeof(y), cudaMemcpyDeviceToHost);

  double worst = 0;
  for (int r = 0, g = 0, end = splits[0]; r < ROWS; ++r) {
    while (r >= end) end += splits[++g];
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += from_bf16(x[r * K + k]) * from_bf16(w[(g * N + n) * K + k]);
      const double err = fabs(from_bf16(y[r * N + n]) - ref);
      if (!(err <= 1e-2 + 1e-2 * fabs(ref))) {
        fprintf(stderr, "c-consumer: y[%d][%d] = %g, expected %g\n", r, n, from_bf16(y[r * N + n]), ref);
        return 1;
      }
      if (err > worst) worst = err;
    }
  }
  mg_grouped_linear_destroy(op);
  if (mg_grouped_linear_backward_dw(op, NULL) != MG_ERR_INVALID_HANDLE) return fail("call after destroy", MG_OK);
  cudaFree(workspace), cudaFree(dx), cudaFree(dw), cudaFree(dy), cudaFree(dsplits);
  printf("c-consumer: grouped linear on caller workspace matches (max abs error %.3g)\n", worst);
  return 0;
}
