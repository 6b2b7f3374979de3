//! Tests of the bounds on what one job spec may grow into: the render budget of v2
//! placeholders ([`MAX_RENDERED_BYTES`], shared by all roles and deployments), the alias
//! byte budget of the YAML layer, and the image `uri` check.

use super::*;
use crate::spec::{parse_job_spec, SpecError};

const KIB: usize = 1024;

/// A v2 spec with one parameter `big` of `param` bytes (line 6) and the roles `roles`
/// (YAML from line 8 on, indented by 2; each role gets `dockerImage: img`).
fn spec(param: usize, roles: &str, tail: &str) -> String {
    format!(
        "protocolVersion: 2\nname: job\ntype: job\nprerequisites: [{{name: img, type: dockerimage, uri: busybox}}]\n\
         parameters:\n  big: {}\ntaskRoles:\n{roles}{tail}",
        "a".repeat(param)
    )
}

/// One role `name` whose one command references `big` `refs` times, separated by spaces.
fn role(name: &str, refs: usize) -> String {
    format!(
        "  {name}:\n    dockerImage: img\n    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 0}}\n    commands:\n      - \"{}\"\n",
        vec!["<% $parameters.big %>"; refs].join(" ")
    )
}

fn errors(text: &str) -> Vec<SpecError> {
    match parse_job_spec(text, "job.yaml") {
        Ok(_) => panic!("expected the spec to be refused"),
        Err(e) => e.0,
    }
}

fn only_budget_error(text: &str, field: &str, line: usize) {
    let e = errors(text);
    assert_eq!(e.len(), 1, "one error, not one per placeholder: {e:?}");
    let e = &e[0];
    assert_eq!((e.field.as_str(), e.line), (field, line), "{e}");
    assert!(
        e.message.contains(&format!("would pass {MAX_RENDERED_BYTES} bytes")),
        "{e}"
    );
    assert!(e.fix.contains("fewer times"), "{e}");
}

#[test]
fn an_expansion_to_gigabytes_is_refused_before_it_is_built() {
    // 64 KiB referenced 20 000 times: 1.3 GB if it were expanded (the spec is ~500 KB).
    let refs = 20_000;
    let text = spec(64 * KIB, &role("w", refs), "");
    assert!(text.len() < 1024 * KIB);
    only_budget_error(&text, "taskRoles.w.commands[0]", 12);
}

#[test]
fn render_never_takes_more_than_the_budget() {
    let doc = super::super::yaml::parse(&format!("p: {}\nc: x\n", "b".repeat(64 * KIB)));
    let root = doc.root.expect("a document");
    let budget = RenderBudget::default();
    let ctx = RenderCtx {
        parameters: Some(&root),
        secrets: None,
        data: None,
        script: None,
        output: None,
        budget: &budget,
    };
    let mut d = Diags::new("job.yaml");
    let w = Warnings::default();
    let node = root.get("c").expect("c");
    // 640 KiB a render: six fit in 4 MiB, the seventh does not.
    let cmd = "<% $parameters.p %>".repeat(10);
    let mut rendered = 0;
    for i in 0..100 {
        match render(&mut d, &w, &cmd, node, &format!("c[{i}]"), &ctx) {
            Some(s) => rendered += s.len(),
            None => break,
        }
    }
    assert!(budget.is_spent());
    assert_eq!(rendered, 6 * 10 * 64 * KIB);
    assert!(budget.used() <= MAX_RENDERED_BYTES);
    // Later renders of the spec are refused silently: the one diagnostic stands.
    assert_eq!(render(&mut d, &w, "echo", node, "c[100]", &ctx), None);
    let e = d.into_result(Some(())).expect_err("refused");
    assert_eq!(e.0.len(), 1, "{e}");
    assert_eq!((e.0[0].field.as_str(), e.0[0].line), ("c[6]", 2));
}

#[test]
fn just_under_the_budget_renders_and_just_over_is_refused() {
    // 63 × 64 KiB + 62 spaces fits in 4 MiB; 64 × 64 KiB + 63 spaces does not.
    let under = spec(64 * KIB, &role("w", 63), "");
    let job = parse_job_spec(&under, "job.yaml").expect("just under the budget");
    assert_eq!(job.task_roles[0].commands[0].len(), 63 * 64 * KIB + 62);
    only_budget_error(&spec(64 * KIB, &role("w", 64), ""), "taskRoles.w.commands[0]", 12);
}

#[test]
fn the_budget_is_shared_by_all_roles_and_deployments() {
    // Each role alone (40 × 64 KiB = 2.5 MiB) fits; the second one passes the total.
    let roles = format!("{}{}", role("a", 40), role("b", 40));
    only_budget_error(&spec(64 * KIB, &roles, ""), "taskRoles.b.commands[0]", 17);
    // A deployment's commands count too (rendered after the role's own).
    let refs = vec!["<% $parameters.big %>"; 40].join(" ");
    let tail = format!(
        "deployments:\n  - name: d\n    taskRoles:\n      w: {{postCommands: [\"{refs}\"]}}\ndefaults: {{deployment: d}}\n"
    );
    only_budget_error(
        &spec(64 * KIB, &role("w", 40), &tail),
        "deployments[0].taskRoles.w.postCommands[0]",
        16,
    );
}

#[test]
fn lists_are_measured_before_they_are_joined() {
    let text = format!(
        "protocolVersion: 2\nname: job\ntype: job\nprerequisites: [{{name: img, type: dockerimage, uri: busybox}}]\n\
         parameters:\n  l: [{}]\ntaskRoles:\n{}",
        vec!["c".repeat(KIB); 300].join(", "),
        role("w", 0).replace("\"\"", &format!("\"{}\"", vec!["<% $parameters.l %>"; 20].join(" ")))
    );
    only_budget_error(&text, "taskRoles.w.commands[0]", 12);
}

#[test]
fn aliases_of_a_long_text_are_bounded() {
    // 200 aliases of a 512 KiB anchored text: 100 MiB (200 MiB with its raw copy) if copied.
    let text = format!("p: &a {}\nq: [{}]\n", "a".repeat(512 * KIB), vec!["*a"; 200].join(", "));
    let doc = super::super::yaml::parse(&text);
    assert!(
        doc.issues
            .iter()
            .any(|i| i.message.contains("aliases") && i.pos.line == 2),
        "{:?}",
        doc.issues
    );
    let root = doc.root.expect("a document");
    let copied: usize = root
        .get("q")
        .and_then(Node::as_seq)
        .unwrap_or_default()
        .iter()
        .map(|n| n.raw.len())
        .sum();
    assert!(copied <= super::super::yaml::MAX_ALIAS_BYTES, "{copied}");
}

#[test]
fn image_uris_that_podman_would_misread_are_refused() {
    for (uri, what) in [
        ("\"-v /:/host busybox\"", "starts with `-`"),
        ("--privileged", "starts with `-`"),
        ("\"busybox --privileged\"", "contains ' '"),
        ("\"busy\\tbox\"", "contains '\\t'"),
        ("\"busy\\nbox\"", "contains '\\n'"),
        ("\"\"", "is empty"),
    ] {
        let text = format!(
            "protocolVersion: 2\nname: job\ntype: job\nprerequisites:\n  - {{name: img, type: dockerimage, uri: {uri}}}\n\
             taskRoles:\n  w:\n    dockerImage: img\n    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 0}}\n    commands: [hi]\n"
        );
        let e = errors(&text);
        assert_eq!(e.len(), 1, "{uri}: {e:?}");
        assert_eq!(
            (e[0].field.as_str(), e[0].line),
            ("prerequisites[0].uri", 5),
            "{uri}: {}",
            e[0]
        );
        assert!(e[0].message.contains(what), "{uri}: {}", e[0]);
    }
    assert_eq!(check_image_uri("registry.example:5000/team/pytorch:2.3-cuda12"), Ok(()));
}

#[test]
fn placeholder_problems_are_listed_up_to_a_cap() {
    // 5 000 undefined and 5 000 unsupported placeholders: 100 listed, the rest counted.
    let cmd = format!(
        "{}{}",
        "<% $parameters.nope %>".repeat(5_000),
        "<% $other %>".repeat(5_000)
    );
    let text = spec(1, &role("w", 0).replace("\"\"", &format!("\"{cmd}\"")), "");
    let e = errors(&text);
    assert_eq!(e.len(), MAX_RENDER_NOTES, "{e:?}");
    assert!(e.iter().all(|e| e.message.contains("unsupported placeholder")), "{e:?}");
    let undefined = spec(
        1,
        &role("w", 0).replace("\"\"", &format!("\"{}\"", "<% $parameters.nope %>".repeat(5_000))),
        "",
    );
    let job = parse_job_spec(&undefined, "job.yaml").expect("undefined placeholders render as nothing");
    assert_eq!(job.warnings.len(), MAX_RENDER_NOTES + 1, "{:?}", job.warnings.last());
    assert!(job
        .warnings
        .iter()
        .any(|w| w.message.contains("the rest are not listed")));
}

/// What a refused spec's diagnostics quote is bounded too: a 300 KB key above a flow map of
/// 5,000 duplicate keys, read under a 100 KB source name, gives at most `MAX_ERRORS` + 1
/// errors whose names and paths are cut (they were each a copy of both).
#[test]
fn diagnostics_of_a_hostile_spec_stay_small() {
    let dups = vec!["a: 1"; 5_000].join(", ");
    let text = format!("name: job\n? {}\n: {{{dups}}}\n", "k".repeat(300 * KIB));
    let source = "s".repeat(100 * KIB);
    let e = match parse_job_spec(&text, &source) {
        Ok(_) => panic!("expected the spec to be refused"),
        Err(e) => e.0,
    };
    assert!(e.len() <= crate::spec::yaml::MAX_ERRORS + 1, "{}", e.len());
    let quoted: usize = e
        .iter()
        .map(|x| x.source.len() + x.field.len() + x.message.len() + x.fix.len())
        .sum();
    assert!(quoted < 400 * KIB, "{quoted} bytes quoted");
    assert!(
        e.iter().any(|x| x.message.contains("duplicate key")),
        "{:?}",
        &e[..e.len().min(3)]
    );
}

/// More `parameters` than a job spec may have are refused, naming the field.
#[test]
fn too_many_parameters_are_refused() {
    let params: String = (0..=crate::spec::parse::MAX_PARAMETERS)
        .map(|i| format!("  p{i}: x\n"))
        .collect();
    let text = format!(
        "protocolVersion: 2\nname: job\ntype: job\nparameters:\n{params}taskRoles:\n  w:\n    \
         resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 0}}\n    commands: [\"echo <% $parameters.p1 %>\"]\n"
    );
    let e = errors(&text);
    assert!(
        e.iter()
            .any(|x| x.field == "parameters" && x.message.contains("more than the 1000")),
        "{e:?}"
    );
}
