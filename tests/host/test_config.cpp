// Config parsing tests (issue 3).
#include <gtest/gtest.h>
