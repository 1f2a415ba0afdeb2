# Probe (copy as sitecustomize.py first on PYTHONPATH): VmRSS / VmHWM after each forward, backward, reduce and step of
# a 2-rank compression run. Answered where the compressed run's extra peak RSS sits: results/compress_w2_rss_diagnostics/README.md.
import os, atexit, sys
_LOG = []
def _st():
    d = {}
    with open('/proc/self/status') as f:
        for l in f:
            if l.startswith(('VmRSS', 'VmHWM', 'RssAnon', 'RssFile')):
                k, v = l.split(':'); d[k] = int(v.split()[0]) // 1024
    return d
def _rec(tag):
    s = _st(); _LOG.append((tag, s.get('VmRSS'), s.get('VmHWM'), s.get('RssAnon'), s.get('RssFile')))
_rec('start')
def _install():
    try:
        import deepspeed.runtime.engine as E
    except Exception:
        return
    cls = E.DeepSpeedEngine
    n = {'i': 0}
    for name in ('forward', 'backward', 'step'):
        orig = getattr(cls, name)
        def wrap(self, *a, __o=orig, __n=name, **k):
            r = __o(self, *a, **k)
            if __n == 'step':
                n['i'] += 1
                if os.environ.get('RSSPROBE_TRIM') and 'compression' in str(getattr(self, '_config', None) and self._config._param_dict.get('titan', {})):
                    import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)
            if n['i'] < 4 or n['i'] % 10 == 0 or __n == 'step':
                _rec(f"{__n}@{n['i']}")
            return r
        setattr(cls, name, wrap)
    oi = cls.__init__
    def init(self, *a, **k):
        oi(self, *a, **k); _rec('engine_init')
    cls.__init__ = init
class _Finder:
    def find_module(self, *a): return None
import builtins
_orig_import = builtins.__import__
_done = {'x': False}
def _imp(name, *a, **k):
    m = _orig_import(name, *a, **k)
    e = sys.modules.get('deepspeed.runtime.engine')
    if not _done['x'] and e is not None and hasattr(e, 'DeepSpeedEngine'):
        _done['x'] = True; _install()
    c = sys.modules.get('titan_ds.comm.compressor')
    if not _done.get('c') and c is not None and hasattr(c, 'GradientReducer'):
        _done['c'] = True
        o = c.GradientReducer.reduce
        def red(self, *a, **k):
            _rec('pre_reduce'); r = o(self, *a, **k); _rec('reduce'); return r
        c.GradientReducer.reduce = red
        if os.environ.get('RSSPROBE_NOJOURNAL'):
            import titan_ds.comm.base as B
            def sl(self, seg, device):
                r = self._get(seg, device); return r[seg.param_offset:seg.param_offset + seg.numel]
            B.ResidualStore.slice_ = sl
    return m
builtins.__import__ = _imp
@atexit.register
def _dump():
    out = os.environ.get('RSSPROBE_OUT')
    if out and _LOG:
        with open(f"{out}.{os.environ.get('RANK','x')}.{os.getpid()}", 'w') as f:
            for r in _LOG: f.write(' '.join(map(str, r)) + '\n')
