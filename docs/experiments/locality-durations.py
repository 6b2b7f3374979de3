# Issue 27 item 4 (docs/BENCHMARKS.md, "Time locality in the learned estimate"): how well a
# Philly job's duration is told by ended jobs of its GPU count (all, the last K by end or by
# submit) and by the previous same-count submit. Run from the repository root.
import csv, math, statistics as st, bisect
rows=list(csv.DictReader(open('data/traces/replay/philly_pass_ge4gpu_jobs.csv')))
J=[(float(r['submit_s']),float(r['duration_s']),int(float(r['total_gpus']))) for r in rows]
J.sort()
from collections import Counter
print(Counter(g for _,_,g in J).most_common(12))
print('median dur',st.median(d for _,d,_ in J))
def ev(name,pred):
    errs=[]
    for i,(s,d,g) in enumerate(J):
        p=pred(i)
        if p is None: continue
        errs.append(abs(math.log(max(p,1))-math.log(max(d,1))))
    errs.sort()
    print(f"{name:40s} n={len(errs)} medAbsLog={errs[len(errs)//2]:.3f} p75={errs[3*len(errs)//4]:.3f}")
def ended_before(i,same=True):
    s,d,g=J[i]
    return [(sj+dj,dj,sj) for sj,dj,gj in J[:i] if sj+dj<=s and (not same or gj==g)]
def allmed(i):
    e=ended_before(i); 
    return st.median([x[1] for x in e]) if len(e)>=5 else None
ev('all ended same gpu median',allmed)
for K in (10,25,50,100,200):
    def f(i,K=K):
        e=ended_before(i)
        if len(e)<5: return None
        e.sort()  # by end time
        return st.median([x[1] for x in e[-K:]])
    ev(f'last {K} by end',f)
    def f2(i,K=K):
        e=ended_before(i)
        if len(e)<5: return None
        e.sort(key=lambda x:x[2])
        return st.median([x[1] for x in e[-K:]])
    ev(f'last {K} by submit',f2)
# previous submitted job same gpu, its duration (oracle-ish: may not have ended)
def prev(i):
    s,d,g=J[i]
    for j in range(i-1,-1,-1):
        if J[j][2]==g: return J[j][1]
ev('prev same-gpu submitted (ORACLE dur)',prev)
