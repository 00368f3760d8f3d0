#include "transfer/xfer.h"

namespace siesta::transfer {

const char* xfer_op_name(XferOp op) { return op == XferOp::kRead ? "READ" : "WRITE"; }

}  // namespace siesta::transfer
