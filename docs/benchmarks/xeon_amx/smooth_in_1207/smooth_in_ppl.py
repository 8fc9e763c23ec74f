"""Block-input smoothing (QuantConfig.smooth_in: qkv_proj and gate_up_proj
inputs smoothed into the RMSNorms before them), measured where it is used:
without the residual rotation. The embedded SmolLM2-135M, the g64 preset
with rotate=False and no scale tuning (faster; the same for both rows),
with and without smooth_in; perplexity of the fake-quant simulation on the
license texts (disjoint 512-token windows), the FP model beside them.
Usage: python smooth_in_ppl.py"""
import time

from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.model_loader import load_model_source
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model, quantize_model

source = load_model_source(None)
ids = source.tokenizer.encode(read_texts(LICENSE_TEXTS), add_special_tokens=False)
cfg0 = get_preset("g64", rotate=False, scale_tuning_epochs=0)
calib = load_calibration(source.tokenizer, None, cfg0.calib_samples, cfg0.calib_seq_len)
fp = build_fp_model(source, get_preset("rtn-kv4", kv_bits=16), "cpu")
print(f"fp: ppl {perplexity(fp.prompt_logprobs, ids, 512, 512).ppl:.3f}", flush=True)
for smooth in (False, True):
    t = time.perf_counter()
    result = quantize_model(source, get_preset("g64", rotate=False, scale_tuning_epochs=0, smooth_in=smooth), calib,
                            progress=False)
    ppl = perplexity(result.model.prompt_logprobs, ids, 512, 512).ppl
    print(f"g64 rotate=False smooth_in={smooth}: ppl {ppl:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
