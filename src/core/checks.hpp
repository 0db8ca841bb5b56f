// Internal check macros for the libraries that public headers do not expose.
#pragma once

#include <cublasLt.h>
#include <nccl.h>

#include "moegraph/error.hpp"

#define MG_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                      \
    cublasStatus_t mg_status_ = (expr);                                                     \
    if (mg_status_ != CUBLAS_STATUS_SUCCESS)                                                \
      ::moegraph::detail::throw_error(__FILE__, __LINE__,                                   \
                                      ::moegraph::detail::concat(#expr, " failed: ",        \
                                                                 cublasLtGetStatusName(mg_status_)), \
                                      ::moegraph::ErrorKind::kLibrary); \
  } while (0)

#define MG_NCCL_CHECK(expr)                                                                 \
  do {                                                                                      \
    ncclResult_t mg_status_ = (expr);                                                       \
    if (mg_status_ != ncclSuccess)                                                          \
      ::moegraph::detail::throw_error(__FILE__, __LINE__,                                   \
                                      ::moegraph::detail::concat(#expr, " failed: ",        \
                                                                 ncclGetErrorString(mg_status_)), \
                                      ::moegraph::ErrorKind::kLibrary); \
  } while (0)
