# Issue 27 item 4 (docs/BENCHMARKS.md, "Time locality in the learned estimate"): the median
# residual time of running Philly jobs from a Kaplan-Meier of the history known then,
# unweighted and weighted by submit-time distance. Run from the repository root.
import csv, math, random
rows=list(csv.DictReader(open('data/traces/replay/philly_pass_ge4gpu_jobs.csv')))
J=sorted((float(r['submit_s']),float(r['duration_s']),int(float(r['total_gpus']))) for r in rows)
random.seed(1)
checks=sorted(random.sample(range(len(J)),250))
def km_median_residual(obs, e):
    # obs: list of (time, ended, weight) sorted; returns median residual beyond e (conditional), None if not reached
    at=sum(w for _,_,w in obs); s=1.0; base=None; i=0; n=len(obs)
    # survival at e
    surv=[]
    while i<n:
        t=obs[i][0]; d=c=0.0
        while i<n and obs[i][0]==t:
            if obs[i][1]: d+=obs[i][2]
            else: c+=obs[i][2]
            i+=1
        if d>0 and at>0:
            s*=max(0,1-d/at); surv.append((t,s))
        at-=d+c
    sb=1.0
    for t,sv in surv:
        if t<=e: sb=sv
        else: break
    tgt=0.5*sb
    for t,sv in surv:
        if t>e and sv<=tgt: return t-e
    return None
def run(kern):
    errs=[]; miss=0
    for k in checks:
        T=J[k][0]
        ended=[(s,d,g) for s,d,g in J if s+d<=T]
        runn=[(s,d,g) for s,d,g in J if s<=T<s+d]
        for (si,di,gi) in runn:
            e=T-si
            own=[x for x in ended if x[2]==gi]
            if len(own)<20: continue
            obs=[(d,True,kern(s-si)) for s,d,g in own]+[(T-s,False,kern(s-si)) for s,d,g in runn if g==gi]
            obs.sort(key=lambda o:(o[0],not o[1]))
            if sum(w for _,en,w in obs if en)<1e-9: r=None
            else: r=km_median_residual(obs,e)
            if r is None: miss+=1; continue
            true=di-e
            errs.append(abs(math.log((r+60)/(true+60))))
    errs.sort()
    return len(errs),miss,errs[len(errs)//2],errs[3*len(errs)//4]
import sys
print('flat',run(lambda d:1.0))
for tau in (3600,20000,86400,3*86400):
    for eps in (0.0,0.05):
        print('exp',tau,eps,run(lambda d,tau=tau,eps=eps:eps+math.exp(-abs(d)/tau)))
