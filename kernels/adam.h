// One AdamW element update, written once for host and device (see cpu_adam.cpp, fused_adam.cu).
#pragma once
