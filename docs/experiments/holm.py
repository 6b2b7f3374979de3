"""Holm's correction over every comparison of the saturated loop (40 seeds).

Usage: python3 holm.py BASEDIR  (saturated-loop.sh's JSON files, every policy)
Two-sided paired t-tests (other - gpuam per seed) on tierIdeal, unionIdeal, qP50 and qP95
for every other policy and setting; prints the smallest p-values, how many comparisons
Holm's procedure at 5 % rejects and in whose favour, and the raw count below 5 %.
"""
import json,math,os,sys
base=sys.argv[1]
def tpdf(x,v): return math.exp(math.lgamma((v+1)/2)-math.lgamma(v/2))/math.sqrt(v*math.pi)*(1+x*x/v)**(-(v+1)/2)
def tsf(t,v):  # P(T>t), t>=0, Simpson on [0,t]
    n=2000; h=t/n; s=tpdf(0,v)+tpdf(t,v)
    for i in range(1,n): s+=(4 if i%2 else 2)*tpdf(i*h,v)
    return 0.5-s*h/3
axes=[('tierIdeal',1),('unionIdeal',1),('queueDelayP50',-1),('queueDelayP95',-1)]
tests=[]
for t in ['pcie8','dgx1v','nvbridge8x','pcie4']:
 for l in ['0.8','0.9']:
  for m in ['A','B']:
    P=json.load(open(os.path.join(base,f'{t}-{l}-{m}.json')))['policies']; g=P['gpuam']['perSeed']
    for pol,Q in P.items():
      if pol=='gpuam': continue
      o=Q['perSeed']
      for ax,sgn in axes:
        d=[(o[i][ax]-g[i][ax])*sgn for i in range(40) if o[i][ax] is not None and g[i][ax] is not None]
        n=len(d); mu=sum(d)/n; sd=math.sqrt(sum((x-mu)**2 for x in d)/(n-1))
        if sd==0: continue
        tt=mu/(sd/math.sqrt(n))
        p=2*tsf(abs(tt),n-1)
        tests.append((p,mu>0,f'{t} {l} {m} {pol}.{ax} mean {mu*sgn:+.4g} t={tt:.2f}'))
tests.sort()
k=len(tests); print('comparisons',k)
for i,(p,worse,desc) in enumerate(tests[:8]):
    print(f'{desc:60} p={p:.5f} holm threshold={0.05/(k-i):.6f} {"other ahead" if worse else "gpuam ahead"}')
# Holm: reject while p < alpha/(k-i)
rej=0
for i,(p,worse,desc) in enumerate(tests):
    if p< 0.05/(k-i): rej+=1
    else: break
print('Holm rejections:',rej,' of which other ahead:',sum(1 for (p,w,d) in tests[:rej] if w))
print('raw p<0.05 with other ahead:',sum(1 for p,w,d in tests if w and p<0.05), ' gpuam ahead:',sum(1 for p,w,d in tests if not w and p<0.05))
