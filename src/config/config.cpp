// Implemented by the config work (issue 3).
#include "moegraph/config.hpp"
