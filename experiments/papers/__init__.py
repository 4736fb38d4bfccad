"""The papers' reproductions: ActNN (actnn_cifar, grad_variance, bit_plans), GACT (gact_tasks)
and AC-GC (acgc_sweep, memory_accounting); BLPA and DIVISION run as variants of actnn_cifar; FP8
storage as COAT and TransformerEngine keep activations, against integer codes (fp8_compare)."""
