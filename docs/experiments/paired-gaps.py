"""Paired gaps of the saturated loop (docs/BENCHMARKS.md, "Where queues form").

Usage: python3 paired-gaps.py BASEDIR [VARIANTDIR]
BASEDIR holds saturated-loop.sh's JSON files for every policy; VARIANTDIR (default BASEDIR)
those of a variant build's gpuam alone. For each setting, prints gpuam's means and every gap
where another policy is ahead outside the paired 95 % interval (other - gpuam over seeds,
Student's t), on seeds 0-19 (a:), 20-39 (b:) and all 40; then the counts and the mean change
of gpuam's qP50, qP95 and tierIdeal against BASEDIR.
"""
import json, sys, os, math
base=sys.argv[1]; var=sys.argv[2] if len(sys.argv)>2 else base
def ci(d):
    d=[x for x in d if x is not None and not math.isnan(x)]
    n=len(d); m=sum(d)/n
    sd=math.sqrt(sum((x-m)**2 for x in d)/(n-1)); t={20:2.093,40:2.023}.get(n,1.96); return m, t*sd/math.sqrt(n)
axes=[('tierIdeal',1),('unionIdeal',1),('queueDelayP50',-1),('queueDelayP95',-1)]
tot={'all':0,'a':0,'b':0}; dq50=[];dq95=[];dti=[]
for t in ['pcie8','dgx1v','nvbridge8x','pcie4']:
 for l in ['0.8','0.9']:
  for m in ['A','B']:
    f=f'{t}-{l}-{m}.json'
    B=json.load(open(os.path.join(base,f)))['policies']; V=json.load(open(os.path.join(var,f)))['policies']
    g=V['gpuam']['perSeed']; g0=B['gpuam']['perSeed']
    dq50.append(sum(x['queueDelayP50'] for x in g)/40-sum(x['queueDelayP50'] for x in g0)/40)
    dq95.append(sum(x['queueDelayP95'] for x in g)/40-sum(x['queueDelayP95'] for x in g0)/40)
    dti.append(sum(x['tierIdeal'] for x in g)/40-sum(x['tierIdeal'] for x in g0)/40)
    losses=[]
    for pol,P in B.items():
        if pol=='gpuam': continue
        o=P['perSeed']
        for ax,sgn in axes:
            for part,rng in [('all',range(40)),('a',range(20)),('b',range(20,40))]:
                d=[(o[i][ax]-g[i][ax])*sgn for i in rng if o[i][ax] is not None and g[i][ax] is not None]
                if len(d)<3: continue
                mu,h=ci(d)
                if mu-h>0:
                    losses.append(f'{part}:{pol}.{ax} {mu*sgn:+.3f}±{h:.3f}' if ax.startswith(('tier','union')) else f'{part}:{pol}.{ax} {mu*sgn:+.0f}±{h:.0f}')
                    tot[part]+=1
    gm=lambda ax: sum(x[ax] for x in g)/40
    print(f'{t:10} {l} {m}  ti {gm("tierIdeal"):.3f} q50 {gm("queueDelayP50"):6.0f} q95 {gm("queueDelayP95"):6.0f}  ', '; '.join(losses))
print('significant losses: seeds0-19',tot['a'],' seeds20-39',tot['b'],' all40',tot['all'])
print(f'mean dq50 {sum(dq50)/16:+.0f}  dq95 {sum(dq95)/16:+.0f}  dtier {sum(dti)/16:+.4f}')
