"""The runtime imports and generates with torch and transformers unimportable (edge devices)."""

import subprocess
import sys

# a script prefix that makes torch, transformers and onnx unimportable (shared with test_chat.py)
BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxscript'):
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
"""

SCRIPT = BLOCK_TORCH + """
from specdec import SpeculativeDecoder, SamplingConfig
dec = SpeculativeDecoder.load(sys.argv[1])
res = dec.generate('def f(x):', max_new_tokens=8, num_draft_tokens=2)
assert len(res.token_ids) == 8
assert not any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules)
print('ok')
"""


def test_runtime_needs_no_torch(tiny_bundle):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_bundle)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
