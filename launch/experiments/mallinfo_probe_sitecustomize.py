# Probe (copy as sitecustomize.py first on PYTHONPATH, RSSPROBE_OUT=PREFIX): glibc mallinfo2 around each phase of a
# 2-rank compression run. Answered how much of the extra peak RSS is malloc arena: results/compress_w2_rss_diagnostics/README.md.
import os, atexit, sys, ctypes
_LOG = []
class _MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ('arena','ordblks','smblks','hblks','hblkhd','usmblks','fsmblks','uordblks','fordblks','keepcost')]
_libc = ctypes.CDLL('libc.so.6'); _libc.mallinfo2.restype = _MI
def _st():
    d = {}
    with open('/proc/self/status') as f:
        for l in f:
            if l.startswith(('VmRSS', 'VmHWM')):
                k, v = l.split(':'); d[k] = int(v.split()[0]) // 1024
    m = _libc.mallinfo2()
    d['arena'] = m.arena >> 20; d['inuse'] = m.uordblks >> 20; d['mmap'] = m.hblkhd >> 20; d['free'] = m.fordblks >> 20
    return d
def _rec(tag):
    s = _st(); _LOG.append((tag, s['VmRSS'], s['VmHWM'], s['arena'], s['inuse'], s['mmap'], s['free']))
_done = {}
import builtins
_orig_import = builtins.__import__
def _imp(name, *a, **k):
    m = _orig_import(name, *a, **k)
    e = sys.modules.get('deepspeed.runtime.engine')
    if 'e' not in _done and e is not None and hasattr(e, 'DeepSpeedEngine'):
        _done['e'] = 1
        cls = e.DeepSpeedEngine
        for nm in ('forward', 'backward', 'step'):
            orig = getattr(cls, nm)
            def wrap(self, *a, __o=orig, __n=nm, **k):
                _rec('pre_' + __n); r = __o(self, *a, **k); _rec(__n); return r
            setattr(cls, nm, wrap)
        oa = cls.allreduce_bucket
        def ar(self, *a, **k):
            _rec('pre_allreduce'); r = oa(self, *a, **k); _rec('allreduce'); return r
        cls.allreduce_bucket = ar
    q = sys.modules.get('titan_ds.comm.qtopk')
    if 'q' not in _done and q is not None and hasattr(q, 'QTopKCompressor'):
        _done['q'] = 1
        o = q.QTopKCompressor.reduce
        def red(self, *a, **k):
            _rec('pre_compress'); r = o(self, *a, **k); _rec('compress'); return r
        q.QTopKCompressor.reduce = red
    return m
builtins.__import__ = _imp
@atexit.register
def _dump():
    out = os.environ.get('RSSPROBE_OUT')
    if out and _LOG:
        with open(f"{out}.{os.environ.get('RANK','x')}.{os.getpid()}", 'w') as f:
            for r in _LOG: f.write(' '.join(map(str, r)) + '\n')
