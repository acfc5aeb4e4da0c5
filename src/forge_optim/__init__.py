"""forge_optim: the optimizer update fused into the weight-gradient GEMM.

    opt = forge_optim.AdamW(model, lr=2e-5, weight_decay=0.01)
    loss.backward()   # fused nn.Linear weights are updated here; their .grad stays None
    opt.step()        # steps everything else
"""
from .optim import (OPTIMIZERS, SGD, Adagrad, Adam, AdamW, ForgeOptimizer, Lion, NAdam, RAdam, RMSprop,
                    STATE_DTYPES)
from .patch import ForgeLinear, unpatch
from .rules import NOT_ELEMENTWISE, RULES

__version__ = "0.1.0"

__all__ = ["AdamW", "Adam", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD", "ForgeOptimizer",
           "ForgeLinear", "unpatch", "RULES", "OPTIMIZERS", "NOT_ELEMENTWISE", "STATE_DTYPES"]
