/* What libmoegraph exports. The library is built with hidden visibility: only declarations marked
 * MOEGRAPH_API (the C ABI in moegraph.h and the C++ API under include/moegraph/) are visible to
 * consumers, so internals can change without breaking them (tests/exports checks the list). */
#ifndef MOEGRAPH_EXPORT_H_
#define MOEGRAPH_EXPORT_H_

#define MOEGRAPH_API __attribute__((visibility("default")))

#endif /* MOEGRAPH_EXPORT_H_ */
