//! Job spec tests: one per user error (field path, line and message asserted), the
//! formats' defaults, the example files, and a no-panic property test.

use std::path::Path;

use super::*;

fn parse(text: &str) -> Result<JobSpec, SpecErrors> {
    parse_job_spec(text, "job.yaml")
}

fn errors(text: &str) -> Vec<SpecError> {
    match parse(text) {
        Ok(spec) => panic!("expected errors, parsed {spec:?}"),
        Err(e) => {
            for x in &e.0 {
                assert_eq!(x.source, "job.yaml");
                assert!(
                    !x.message.is_empty() && !x.fix.is_empty(),
                    "every error has a message and a fix: {x}"
                );
            }
            e.0
        }
    }
}

/// Exactly one error, at `field` on `line`, with `fragment` in its message.
fn one(text: &str, field: &str, line: usize, fragment: &str) -> SpecError {
    let e = errors(text);
    assert_eq!(e.len(), 1, "expected one error, got:\n{}", SpecErrors(e.clone()));
    let e = e.into_iter().next().unwrap();
    assert_eq!(e.field, field, "{e}");
    assert_eq!(e.line, line, "{e}");
    assert!(e.message.contains(fragment), "`{fragment}` not in: {e}");
    e
}

/// A valid native spec whose role body is `body` (lines indented by 4 spaces); the role
/// body starts on line 4.
fn role(body: &str) -> String {
    format!("name: job\ntaskRoles:\n  worker:\n{body}")
}

const RES: &str = "    resourcePerInstance: {cpu: 4, memoryMB: 8192, gpu: 1}\n";
const CMD: &str = "    commands: [\"echo hi\"]\n";

fn ok_role(extra: &str) -> String {
    role(&format!("{RES}{CMD}{extra}"))
}

/// A protocol v2 spec: the header (3 lines), then `body`. Unless `body` lists its own
/// prerequisites, every role (its `commands:` line) gets `dockerImage: img`, added on the
/// line after `commands`, and a matching prerequisite is appended at the end, so the lines
/// of the body up to each `commands:` keep their numbers.
fn v2(body: &str) -> String {
    let body = if body.contains("prerequisites:") {
        body.to_string()
    } else {
        let mut out = String::new();
        for line in body.lines() {
            out.push_str(line);
            out.push('\n');
            if line.starts_with("    commands:") {
                out.push_str("    dockerImage: img\n");
            }
        }
        out.push_str("prerequisites: [{name: img, type: dockerimage, uri: busybox}]\n");
        out
    };
    format!("protocolVersion: 2\nname: job\ntype: job\n{body}")
}

const V2_ROLE: &str = "taskRoles:\n  worker:\n    instances: 2\n    resourcePerInstance: {cpu: 4, memoryMB: 8192, gpu: 1}\n    commands: [\"echo hi\"]\n";

// ---- valid specs and defaults ----

#[test]
fn minimal_native_spec_and_defaults() {
    let s = parse(&ok_role("")).unwrap();
    assert_eq!(s.name, "job");
    assert_eq!(s.format, SpecFormat::Native);
    assert!(!s.gang);
    assert_eq!(s.gang_timeout_sec, None);
    let r = &s.task_roles[0];
    assert_eq!((r.name.as_str(), r.instances), ("worker", 1));
    assert_eq!((r.resources.cpu, r.resources.memory_mb, r.resources.gpus), (4, 8192, 1));
    assert_eq!(r.resources.gpu_mask, None);
    assert_eq!(r.task_retry_count, 0);
    assert_eq!(r.completion, Completion::default());
    assert!(r.gpu_types.is_empty() && r.node_label.is_none() && !r.same_port_allocation);
    assert_eq!(r.commands, vec!["echo hi"]);
}

#[test]
fn native_gpu_defaults_to_zero() {
    let s = parse(&role(&format!(
        "    resourcePerInstance: {{cpu: 1, memoryMB: 1}}\n{CMD}"
    )))
    .unwrap();
    assert_eq!(s.task_roles[0].resources.gpus, 0);
}

#[test]
fn native_gpu_follows_an_explicit_mask() {
    let s = parse(&role(&format!(
        "    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpuMask: 0x30}}\n{CMD}"
    )))
    .unwrap();
    let r = &s.task_roles[0].resources;
    assert_eq!((r.gpus, r.gpu_mask), (2, Some(0x30)));
}

#[test]
fn full_native_role() {
    let text = "name: ddp\ngang: true\ngangTimeoutSec: 60\ndescription: test\ntaskRoles:\n  worker:\n    instances: 4\n    resourcePerInstance:\n      cpu: 8\n      memoryMB: 32768\n      gpu: 2\n      gpuMask: \"0x3\"\n      ports: {nccl: 1, http: {start: 9000, count: 2}, dyn: {count: 3}}\n    gpuType: \" V100 , A100\"\n    nodeLabel: gpu\n    samePortAllocation: true\n    commands: [\"a\", \"b\"]\n    taskRetryCount: -2\n    completion: {minFailedInstances: 2, minSucceededInstances: 4}\n";
    let s = parse(text).unwrap();
    assert!(s.gang);
    assert_eq!(s.gang_timeout_sec, Some(60));
    let r = &s.task_roles[0];
    assert_eq!(r.resources.gpu_mask, Some(0x3));
    assert_eq!(
        r.resources.ports,
        vec![
            PortRequest {
                label: "nccl".into(),
                count: 1,
                start: None
            },
            PortRequest {
                label: "http".into(),
                count: 2,
                start: Some(9000)
            },
            PortRequest {
                label: "dyn".into(),
                count: 3,
                start: None
            },
        ]
    );
    assert_eq!(r.resources.static_ports().to_string(), "9000-9001");
    assert_eq!(r.resources.dynamic_port_count(), 4);
    assert_eq!(r.gpu_types, vec!["V100", "A100"]);
    assert_eq!(r.node_label.as_deref(), Some("gpu"));
    assert!(r.same_port_allocation);
    assert_eq!(r.task_retry_count, -2);
    assert_eq!(
        r.completion,
        Completion {
            min_failed_instances: Some(2),
            min_succeeded_instances: Some(4)
        }
    );
}

#[test]
fn static_port_with_start_zero_is_dynamic() {
    let s = parse(&role(&format!(
        "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{a: {{start: 0, count: 2}}}}}}\n{CMD}"
    )))
    .unwrap();
    assert_eq!(s.task_roles[0].resources.ports[0].start, None);
}

#[test]
fn native_completion_null_and_minus_one_mean_never() {
    let s = parse(&ok_role(
        "    completion: {minFailedInstances: null, minSucceededInstances: -1}\n",
    ))
    .unwrap();
    assert_eq!(
        s.task_roles[0].completion,
        Completion {
            min_failed_instances: None,
            min_succeeded_instances: None
        }
    );
}

#[test]
fn scalars_read_as_text_where_text_is_expected() {
    let s = parse(&format!(
        "name: 2024\ntaskRoles:\n  worker:\n{RES}    commands: [true, 42]\n"
    ))
    .unwrap();
    assert_eq!(s.name, "2024");
    assert_eq!(s.task_roles[0].commands, vec!["true", "42"]);
}

#[test]
fn roles_keep_file_order() {
    let s = parse(&format!("name: j\ntaskRoles:\n  z:\n{RES}{CMD}  a:\n{RES}{CMD}")).unwrap();
    let names: Vec<_> = s.task_roles.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, vec!["z", "a"]);
    assert_eq!(s.total_tasks(), 2);
}

#[test]
fn small_anchors_and_aliases_are_allowed() {
    let text = "name: j\ntaskRoles:\n  a:\n    resourcePerInstance: &r {cpu: 2, memoryMB: 10}\n    commands: [x]\n  b:\n    resourcePerInstance: *r\n    commands: [y]\n";
    let s = parse(text).unwrap();
    assert_eq!(s.task_roles[1].resources.cpu, 2);
}

// ---- OpenPAI protocol v2 ----

#[test]
fn v2_defaults() {
    let s = parse(&v2(V2_ROLE)).unwrap();
    assert_eq!(s.format, SpecFormat::PaiV2);
    assert!(s.gang, "v2 gang allocation is on by default");
    let r = &s.task_roles[0];
    assert_eq!(
        r.completion,
        Completion {
            min_failed_instances: Some(1),
            min_succeeded_instances: Some(2)
        }
    );
}

#[test]
fn v2_protocol_version_as_string_and_gang_off() {
    let text = v2(&format!(
        "extras: {{gangAllocation: false, gangTimeoutSec: 30}}\n{V2_ROLE}"
    ))
    .replacen("protocolVersion: 2", "protocolVersion: \"2\"", 1);
    let s = parse(&text).unwrap();
    assert!(!s.gang);
    assert_eq!(s.gang_timeout_sec, Some(30));
}

#[test]
fn v2_accepts_docker_image_prerequisites_and_ignores_them() {
    let text = v2("jobRetryCount: 1\nprerequisites:\n  - {name: img, type: dockerimage, uri: x/y:z}\ndefaults: {virtualCluster: default}\ntaskRoles:\n  worker:\n    dockerImage: img\n    extraContainerOptions: {shmMB: 1024}\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [x]\n");
    let s = parse(&text).unwrap();
    assert_eq!(s.task_roles[0].commands, vec!["x"]);
}

#[test]
fn v2_completion_minus_one_and_null() {
    let text = v2("taskRoles:\n  w:\n    instances: 3\n    completion: {minFailedInstances: -1, minSucceededInstances: null}\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [x]\n");
    let c = parse(&text).unwrap().task_roles[0].completion.clone();
    assert_eq!(
        c,
        Completion {
            min_failed_instances: None,
            min_succeeded_instances: None
        }
    );
}

#[test]
fn v2_renders_parameters() {
    let text = v2("parameters: {epochs: 10, opt: {lr: '0.1'}}\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [\"train --epochs <% $parameters.epochs %> --lr <%$parameters.opt.lr%>\"]\n");
    assert_eq!(
        parse(&text).unwrap().task_roles[0].commands,
        vec!["train --epochs 10 --lr 0.1"]
    );
}

#[test]
fn v2_deployment_wraps_commands() {
    let text = v2("deployments:\n  - name: d\n    taskRoles:\n      w: {preCommands: [pre], postCommands: [post]}\ndefaults: {deployment: d}\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [main]\n");
    // One newline-joined script, as OpenPAI runs it.
    assert_eq!(parse(&text).unwrap().task_roles[0].commands, vec!["pre\nmain\npost"]);
}

#[test]
fn native_does_not_render_placeholders() {
    let s = parse(&role(&format!("{RES}    commands: [\"echo <% $parameters.x %>\"]\n"))).unwrap();
    assert_eq!(s.task_roles[0].commands, vec!["echo <% $parameters.x %>"]);
}

// ---- one test per user error ----

#[test]
fn yaml_syntax_error() {
    // The unclosed `[` is on line 2, not where the parser noticed it (line 3).
    let e = one("name: job\ntaskRoles: [a, b\n", "taskRoles", 2, "`[` is not closed");
    assert_eq!(e.col, 12);
    assert!(e.fix.contains("`]`"), "{e}");
}

#[test]
fn key_without_colon_is_blamed_on_its_own_line() {
    let e = one(
        "name: job\ntaskRoles:\n  worker:\n    instances 2\n    commands: [x]\n",
        "taskRoles",
        4,
        "`instances 2` has no `:`",
    );
    assert_eq!(e.fix, "write `instances: 2`");
}

#[test]
fn yaml_errors_never_have_an_empty_field() {
    for text in ["a: [1\n", "\"x\n", "a: b: c\n", "a:\n  b: 1\n c: 2\n", "- a\nb: 1\n"] {
        for e in errors(text) {
            assert!(!e.field.is_empty(), "{text:?}: {e}");
        }
    }
}

#[test]
fn bad_indentation() {
    let e = errors("name: job\ntaskRoles:\n  worker:\n    instances: 1\n   commands: [x]\n");
    assert_eq!(e.len(), 1);
    assert!(e[0].message.contains("syntax"), "{}", e[0]);
    assert_eq!(e[0].line, 5);
}

#[test]
fn top_level_not_a_mapping() {
    one("- name: job\n", "", 1, "must be a mapping");
}

#[test]
fn empty_file() {
    one("# nothing here\n", "", 1, "empty");
}

#[test]
fn unknown_top_level_field_with_suggestion() {
    let text = format!("nmae: x\n{}", ok_role("").replacen("name: job\n", "", 1));
    let e = errors(&text);
    let got: Vec<_> = e.iter().map(|e| (e.field.as_str(), e.line)).collect();
    assert_eq!(got, vec![("nmae", 1), ("name", 1)]);
    assert!(e[0].fix.contains("did you mean `name`?"), "{}", e[0]);
    assert!(e[1].message.contains("missing required field `name`"), "{}", e[1]);
}

#[test]
fn unknown_role_field_suggests_instances() {
    let e = one(
        &ok_role("    instance: 2\n"),
        "taskRoles.worker.instance",
        6,
        "unknown field `instance`",
    );
    assert_eq!(e.col, 5);
    assert!(e.fix.contains("did you mean `instances`?"), "{e}");
}

#[test]
fn unknown_resource_field_suggests_gpu() {
    let e = one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 4, memoryMB: 8192, gpus: 1}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.gpus",
        4,
        "unknown field",
    );
    assert!(e.fix.contains("`gpu`"), "{e}");
}

#[test]
fn frameworklauncher_names_get_hints() {
    let e = one(
        &ok_role("    taskNumber: 2\n"),
        "taskRoles.worker.taskNumber",
        6,
        "unknown field",
    );
    assert!(e.fix.contains("`instances`"), "{e}");
}

#[test]
fn unknown_field_without_close_match_lists_allowed() {
    let e = one(
        &ok_role("    zzzzzzzz: 2\n"),
        "taskRoles.worker.zzzzzzzz",
        6,
        "unknown field",
    );
    assert!(e.fix.contains("allowed here: instances"), "{e}");
}

#[test]
fn merge_keys_are_explained() {
    let e = one(&ok_role("    <<: {x: 1}\n"), "taskRoles.worker.<<", 6, "unknown field");
    assert!(e.fix.contains("merge keys"), "{e}");
}

#[test]
fn quoted_number_where_int_expected() {
    let e = one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: \"4\", memoryMB: 8192}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.cpu",
        4,
        "must be a number",
    );
    assert!(e.fix.contains("remove the quotes"), "{e}");
}

#[test]
fn float_where_int_expected() {
    let e = one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 4.5, memoryMB: 8192, gpu: 1}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.cpu",
        4,
        "whole number",
    );
    assert_eq!(e.col, 32);
}

fn gpu_spec(gpu: &str, extra: &str) -> String {
    role(&format!(
        "    resourcePerInstance: {{cpu: 4, memoryMB: 8192, gpu: {gpu}{extra}}}\n{CMD}"
    ))
}

#[test]
fn a_gpu_share_below_one_is_read_exactly() {
    for (text, h) in [
        ("0.25", 25),
        ("0.5", 50),
        (".75", 75),
        ("0.01", 1),
        ("0.99", 99),
        ("0.10", 10),
    ] {
        let j = parse(&gpu_spec(text, "")).unwrap_or_else(|e| panic!("{text}: {e}"));
        let r = &j.task_roles[0].resources;
        assert_eq!((r.gpus, r.gpu_share), (1, Some(h)), "{text}");
        assert!(r.uses_gpus());
    }
    let j = parse(&gpu_spec("2.0", "")).unwrap();
    assert_eq!(
        (j.task_roles[0].resources.gpus, j.task_roles[0].resources.gpu_share),
        (2, None)
    );
    let j = parse(&gpu_spec("0.5", ", gpuMask: \"0x2\"")).unwrap();
    let req = j.task_roles[0].resources.as_request();
    assert_eq!(req.gpu_text(), "0x2 (1:0.5)", "a pinned share sits on its GPU");
}

#[test]
fn a_gpu_fraction_above_one_is_refused_as_ray_does() {
    let e = one(
        &gpu_spec("1.5", ""),
        "taskRoles.worker.resourcePerInstance.gpu",
        4,
        "above 1, GPUs are whole",
    );
    assert_eq!(e.col, 56);
    assert!(e.fix.contains("use 1 or 2"), "{e}");
    let e = one(
        &gpu_spec("2.25", ""),
        "taskRoles.worker.resourcePerInstance.gpu",
        4,
        "2.25",
    );
    assert!(e.fix.contains("use 2 or 3"), "{e}");
}

#[test]
fn a_gpu_share_finer_than_a_hundredth_is_refused() {
    let e = one(
        &gpu_spec("0.001", ""),
        "taskRoles.worker.resourcePerInstance.gpu",
        4,
        "finer than 0.01",
    );
    assert!(e.fix.contains("0.25"), "{e}");
    one(
        &gpu_spec("-0.5", ""),
        "taskRoles.worker.resourcePerInstance.gpu",
        4,
        "negative",
    );
    let e = one(
        &gpu_spec("\"0.5\"", ""),
        "taskRoles.worker.resourcePerInstance.gpu",
        4,
        "text",
    );
    assert!(e.fix.contains("remove the quotes"), "{e}");
}

#[test]
fn a_gpu_share_takes_a_one_bit_mask_only() {
    let e = one(
        &gpu_spec("0.5", ", gpuMask: \"0x3\""),
        "taskRoles.worker.resourcePerInstance.gpuMask",
        4,
        "one GPU",
    );
    assert!(e.fix.contains("one bit"), "{e}");
}

#[test]
fn openpai_v2_keeps_gpus_whole() {
    let e = one(
        &v2(&V2_ROLE.replace("gpu: 1}", "gpu: 0.5}")),
        "taskRoles.worker.resourcePerInstance.gpu",
        7,
        "OpenPAI protocol v2 counts whole GPUs",
    );
    assert!(e.fix.contains("gpuam's own job format"), "{e}");
    let e = one(
        &v2(&V2_ROLE.replace("gpu: 1}", "gpu: 1, resources: {nvme: 1}}")),
        "taskRoles.worker.resourcePerInstance.resources",
        7,
        "not part of OpenPAI protocol v2",
    );
    assert!(e.fix.contains("gpuam's own format"), "{e}");
}

#[test]
fn custom_resources_per_task() {
    let j = parse(&gpu_spec("1", ", resources: {nvme: 1, ib_hca: 2}")).unwrap();
    let r = &j.task_roles[0].resources;
    assert_eq!(r.custom.to_text(), "ib_hca=2,nvme=1");
    assert_eq!(r.as_request().custom, r.custom);
    let e = one(
        &gpu_spec("1", ", resources: {gpu: 1}"),
        "taskRoles.worker.resourcePerInstance.resources.gpu",
        4,
        "built-in resource",
    );
    assert!(e.fix.contains("beside `resources`"), "{e}");
    one(
        &gpu_spec("1", ", resources: {nvme: 0}"),
        "taskRoles.worker.resourcePerInstance.resources.nvme",
        4,
        "at least 1",
    );
    one(
        &gpu_spec("1", ", resources: {\"a b\": 1}"),
        "taskRoles.worker.resourcePerInstance.resources.a b",
        4,
        "not a resource name",
    );
    one(
        &gpu_spec("1", ", resources: [nvme]"),
        "taskRoles.worker.resourcePerInstance.resources",
        4,
        "expected a mapping",
    );
}

#[test]
fn negative_memory() {
    one(
        &role(&format!("    resourcePerInstance: {{cpu: 4, memoryMB: -1}}\n{CMD}")),
        "taskRoles.worker.resourcePerInstance.memoryMB",
        4,
        "negative",
    );
}

#[test]
fn bool_where_int_expected() {
    one(
        &ok_role("    instances: true\n"),
        "taskRoles.worker.instances",
        6,
        "whole number, found the boolean",
    );
}

#[test]
fn huge_integer() {
    one(
        &ok_role("    instances: 99999999999999999999999\n"),
        "taskRoles.worker.instances",
        6,
        "too large",
    );
}

#[test]
fn text_where_bool_expected() {
    one(
        &ok_role("    samePortAllocation: yes\n"),
        "taskRoles.worker.samePortAllocation",
        6,
        "true or false",
    );
}

#[test]
fn missing_name() {
    let e = one(
        "taskRoles:\n  worker:\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [x]\n",
        "name",
        1,
        "missing required field `name`",
    );
    assert_eq!(e.col, 1);
}

#[test]
fn missing_task_roles() {
    one("name: job\n", "taskRoles", 1, "missing required field `taskRoles`");
}

#[test]
fn empty_task_roles() {
    one("name: job\ntaskRoles: {}\n", "taskRoles", 2, "empty");
}

#[test]
fn task_roles_not_a_mapping() {
    one("name: job\ntaskRoles: [worker]\n", "taskRoles", 2, "expected a mapping");
}

#[test]
fn missing_resources() {
    one(
        &role(CMD),
        "taskRoles.worker.resourcePerInstance",
        4,
        "missing required field",
    );
}

#[test]
fn missing_cpu_and_memory_are_both_reported_at_the_parent() {
    let e = errors(&role(&format!("    resourcePerInstance: {{gpu: 1}}\n{CMD}")));
    let got: Vec<_> = e.iter().map(|e| (e.field.as_str(), e.line, e.col)).collect();
    assert_eq!(
        got,
        vec![
            ("taskRoles.worker.resourcePerInstance.cpu", 4, 26),
            ("taskRoles.worker.resourcePerInstance.memoryMB", 4, 26)
        ]
    );
}

#[test]
fn v2_requires_gpu() {
    let text = v2("taskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [x]\n");
    one(
        &text,
        "taskRoles.w.resourcePerInstance.gpu",
        6,
        "missing required field `gpu`",
    );
}

#[test]
fn missing_commands() {
    one(
        &role(RES),
        "taskRoles.worker.commands",
        4,
        "missing required field `commands`",
    );
}

#[test]
fn invalid_job_name() {
    let e = one(
        &ok_role("").replacen("name: job", "name: my job!", 1),
        "name",
        1,
        "invalid job name",
    );
    assert!(e.fix.contains("letters, digits"), "{e}");
}

#[test]
fn job_name_too_long() {
    let long = "a".repeat(256);
    one(
        &ok_role("").replacen("name: job", &format!("name: {long}"), 1),
        "name",
        1,
        "invalid job name",
    );
}

#[test]
fn invalid_role_name() {
    let e = one(
        &ok_role("").replacen("worker:", "my-worker:", 1),
        "taskRoles.my-worker",
        3,
        "invalid task role name",
    );
    assert!(e.fix.contains("my_worker"), "{e}");
    assert!(e.fix.contains("GPUAM_HOSTS_"), "{e}");
}

#[test]
fn role_name_starting_with_a_digit() {
    one(
        &ok_role("").replacen("worker:", "1worker:", 1),
        "taskRoles.1worker",
        3,
        "invalid task role name",
    );
}

#[test]
fn invalid_port_label() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{\"a:b\": 1}}}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.ports.a:b",
        4,
        "invalid port label",
    );
}

#[test]
fn duplicate_keys_are_all_reported() {
    let text = "name: job\nname: other\ntaskRoles:\n  worker:\n    instances: 1\n    instances: 2\n    resourcePerInstance: {cpu: 1, memoryMB: 1}\n    commands: [x]\n";
    let e = errors(text);
    let got: Vec<_> = e.iter().map(|e| (e.field.as_str(), e.line)).collect();
    assert_eq!(got, vec![("name", 2), ("taskRoles.worker.instances", 6)]);
    assert!(
        e[0].message.contains("duplicate key `name` (first given on line 1)"),
        "{}",
        e[0]
    );
}

#[test]
fn gpu_mask_popcount_differs_from_gpu() {
    let e = one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 2, gpuMask: \"0x7\"}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.gpuMask",
        4,
        "selects 3 GPU(s) but `gpu` is 2",
    );
    assert!(e.fix.contains("(3)"), "{e}");
}

#[test]
fn gpu_mask_beyond_64_bits() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 1, gpuMask: \"0x10000000000000000\"}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.gpuMask",
        4,
        "more than 64 bits",
    );
}

#[test]
fn gpu_mask_not_a_mask() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 1, gpuMask: \"0xzz\"}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.gpuMask",
        4,
        "not a GPU mask",
    );
}

#[test]
fn static_port_range_past_65535() {
    let e = one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{a: {{start: 65530, count: 10}}}}}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.ports.a",
        4,
        "past 65535",
    );
    assert!(e.fix.contains("65526"), "{e}");
}

#[test]
fn static_port_ranges_overlap() {
    let text = role(&format!("    resourcePerInstance:\n      cpu: 1\n      memoryMB: 1\n      ports:\n        a: {{start: 9000, count: 5}}\n        b: 3\n        c: {{start: 9004, count: 1}}\n{CMD}"));
    one(
        &text,
        "taskRoles.worker.resourcePerInstance.ports.c",
        10,
        "overlap those of `a`",
    );
}

#[test]
fn port_count_zero() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{http: 0}}}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.ports.http",
        4,
        "at least 1",
    );
}

#[test]
fn static_port_missing_count() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{http: {{start: 80}}}}}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.ports.http.count",
        4,
        "missing required field `count`",
    );
}

#[test]
fn too_many_ports_per_task() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{a: 600, b: 600}}}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.ports",
        4,
        "1200 ports per task",
    );
}

#[test]
fn too_many_port_labels() {
    let labels: Vec<String> = (0..257).map(|i| format!("p{i}: 1")).collect();
    let text = role(&format!(
        "    resourcePerInstance: {{cpu: 1, memoryMB: 1, ports: {{{}}}}}\n{CMD}",
        labels.join(", ")
    ));
    one(
        &text,
        "taskRoles.worker.resourcePerInstance.ports",
        4,
        "257 port labels",
    );
}

#[test]
fn empty_commands_list() {
    one(
        &role(&format!("{RES}    commands: []\n")),
        "taskRoles.worker.commands",
        5,
        "`commands` is empty",
    );
}

#[test]
fn empty_command_string() {
    one(
        &role(&format!("{RES}    commands: [\"ok\", \"  \"]\n")),
        "taskRoles.worker.commands[1]",
        5,
        "empty command",
    );
}

#[test]
fn null_command() {
    one(
        &role(&format!("{RES}    commands:\n      -\n")),
        "taskRoles.worker.commands[0]",
        6,
        "empty command",
    );
}

#[test]
fn commands_not_a_list() {
    let e = one(
        &role(&format!("{RES}    commands: echo hi\n")),
        "taskRoles.worker.commands",
        5,
        "expected a list",
    );
    assert!(e.fix.contains("commands: ["), "{e}");
}

#[test]
fn too_many_commands() {
    let cmds = vec!["x"; 1001].join(", ");
    one(
        &role(&format!("{RES}    commands: [{cmds}]\n")),
        "taskRoles.worker.commands",
        5,
        "1001 commands",
    );
}

#[test]
fn completion_count_above_instances() {
    let e = one(
        &ok_role("    instances: 2\n    completion: {minSucceededInstances: 3}\n"),
        "taskRoles.worker.completion.minSucceededInstances",
        7,
        "only 2 instance(s)",
    );
    assert!(e.fix.contains("1 to 2"), "{e}");
}

#[test]
fn completion_count_zero() {
    one(
        &ok_role("    completion: {minFailedInstances: 0}\n"),
        "taskRoles.worker.completion.minFailedInstances",
        6,
        "at least 1",
    );
}

#[test]
fn completion_wrong_type() {
    one(
        &ok_role("    completion: {minSucceededInstances: all}\n"),
        "taskRoles.worker.completion.minSucceededInstances",
        6,
        "whole number",
    );
}

#[test]
fn completion_unknown_field() {
    let e = one(
        &ok_role("    completion: {minFailedTaskCount: 1}\n"),
        "taskRoles.worker.completion.minFailedTaskCount",
        6,
        "unknown field",
    );
    assert!(e.fix.contains("minFailedInstances"), "{e}");
}

#[test]
fn task_retry_count_below_minus_two() {
    one(
        &ok_role("    taskRetryCount: -3\n"),
        "taskRoles.worker.taskRetryCount",
        6,
        "at least -2",
    );
}

#[test]
fn instances_zero() {
    one(
        &ok_role("    instances: 0\n"),
        "taskRoles.worker.instances",
        6,
        "at least 1",
    );
}

#[test]
fn instances_above_limit() {
    one(
        &ok_role("    instances: 10001\n"),
        "taskRoles.worker.instances",
        6,
        "at most 10000",
    );
}

#[test]
fn total_tasks_above_limit() {
    let roles: String = (0..11)
        .map(|i| format!("  r{i}:\n    instances: 10000\n{RES}{CMD}"))
        .collect();
    one(&format!("name: j\ntaskRoles:\n{roles}"), "taskRoles", 3, "110000 tasks");
}

#[test]
fn too_many_roles() {
    let roles: String = (0..65)
        .map(|i| format!("  r{i}: {{resourcePerInstance: {{cpu: 1, memoryMB: 1}}, commands: [x]}}\n"))
        .collect();
    one(
        &format!("name: j\ntaskRoles:\n{roles}"),
        "taskRoles",
        3,
        "65 task roles",
    );
}

#[test]
fn gpu_above_64() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 65}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.gpu",
        4,
        "at most 64",
    );
}

#[test]
fn cpu_zero() {
    one(
        &role(&format!("    resourcePerInstance: {{cpu: 0, memoryMB: 1}}\n{CMD}")),
        "taskRoles.worker.resourcePerInstance.cpu",
        4,
        "at least 1",
    );
}

#[test]
fn memory_above_limit() {
    one(
        &role(&format!(
            "    resourcePerInstance: {{cpu: 1, memoryMB: 16777217}}\n{CMD}"
        )),
        "taskRoles.worker.resourcePerInstance.memoryMB",
        4,
        "at most 16777216",
    );
}

#[test]
fn gpu_type_with_empty_entry() {
    one(
        &ok_role("    gpuType: \"V100,,A100\"\n"),
        "taskRoles.worker.gpuType",
        6,
        "empty GPU type",
    );
}

#[test]
fn empty_node_label() {
    one(
        &ok_role("    nodeLabel: \" \"\n"),
        "taskRoles.worker.nodeLabel",
        6,
        "empty",
    );
}

#[test]
fn gang_timeout_without_gang() {
    let text = ok_role("").replacen("name: job\n", "name: job\ngangTimeoutSec: 10\n", 1);
    one(&text, "gangTimeoutSec", 2, "only applies to gang jobs");
}

#[test]
fn gang_not_a_bool() {
    let text = ok_role("").replacen("name: job\n", "name: job\ngang: \"true\"\n", 1);
    one(&text, "gang", 2, "true or false");
}

#[test]
fn spec_larger_than_one_mib() {
    let text = format!("{}# {}\n", ok_role(""), "x".repeat(limits::MAX_SPEC_BYTES));
    let e = one(&text, "", 0, "limit is 1048576");
    assert_eq!(e.col, 0);
}

#[test]
fn alias_bomb_is_rejected() {
    let mut text = String::from("name: j\na: &a [x, x, x, x, x, x, x, x, x, x]\n");
    let mut prev = 'a';
    for c in ['b', 'c', 'd', 'e', 'f'] {
        text.push_str(&format!(
            "{c}: &{c} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
        ));
        prev = c;
    }
    let e = errors(&text);
    assert!(
        // Once, where the budget runs out (the aliases after it are not copied, nor
        // reported again).
        e.iter()
            .filter(|e| e.message.contains("aliases"))
            .map(|e| e.line)
            .collect::<Vec<_>>()
            == [5],
        "{}",
        SpecErrors(e.clone())
    );
}

#[test]
fn unknown_protocol_version() {
    let e = one(
        &v2(V2_ROLE).replacen("protocolVersion: 2", "protocolVersion: 3", 1),
        "protocolVersion",
        1,
        "unknown protocolVersion",
    );
    assert!(e.fix.contains("protocolVersion: 2"), "{e}");
}

#[test]
fn v2_type_other_than_job() {
    one(
        &v2(V2_ROLE).replacen("type: job", "type: service", 1),
        "type",
        3,
        "only `job`",
    );
}

#[test]
fn v2_missing_type() {
    one(
        &v2(V2_ROLE).replacen("type: job\n", "", 1),
        "type",
        1,
        "missing required field `type`",
    );
}

#[test]
fn v2_undefined_parameter() {
    let text = v2("parameters: {epochs: 1}\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [\"train <% $parameters.epoch %>\"]\n");
    // OpenPAI renders an undefined name as empty text; gpuam does the same and warns.
    let s = parse(&text).unwrap();
    assert_eq!(s.task_roles[0].commands, vec!["train"]);
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    assert_eq!(
        (s.warnings[0].line, s.warnings[0].field.as_str()),
        (8, "taskRoles.w.commands[0]")
    );
    assert!(s.warnings[0].message.contains("$parameters.epoch"), "{}", s.warnings[0]);
}

#[test]
fn v2_secret_in_command() {
    let text = v2("secrets: {pw: hunter22}\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [\"login <% $secrets.pw %> now\"]\n");
    let s = parse(&text).unwrap();
    assert_eq!(s.task_roles[0].commands, vec!["login hunter22 now"]);
}

#[test]
fn v2_unclosed_placeholder() {
    let text = v2("taskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [\"x <% $parameters.a\"]\n");
    one(&text, "taskRoles.w.commands[0]", 7, "unclosed");
}

#[test]
fn v2_gang_at_top_level_points_to_extras() {
    let e = one(&v2(&format!("gang: false\n{V2_ROLE}")), "gang", 4, "unknown field");
    assert!(e.fix.contains("extras.gangAllocation"), "{e}");
}

#[test]
fn v2_unknown_deployment() {
    let text = v2(&format!("defaults: {{deployment: nope}}\n{V2_ROLE}"));
    one(&text, "defaults.deployment", 4, "not defined");
}

#[test]
fn v2_bad_prerequisite_type() {
    let text = v2(&format!("prerequisites:\n  - {{name: x, type: blob, uri: u}}\n  - {{name: img, type: dockerimage, uri: b}}\n{V2_ROLE}    dockerImage: img\n"));
    one(&text, "prerequisites[0].type", 5, "unknown prerequisite type");
}

#[test]
fn all_errors_are_collected_in_line_order() {
    let text = "name: bad name\ntaskRoles:\n  worker:\n    instance: 2\n    resourcePerInstance: {cpu: -1, memoryMB: x}\n    commands: []\n";
    let e = errors(text);
    let got: Vec<_> = e.iter().map(|e| (e.line, e.field.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (1, "name"),
            (4, "taskRoles.worker.instance"),
            (5, "taskRoles.worker.resourcePerInstance.cpu"),
            (5, "taskRoles.worker.resourcePerInstance.memoryMB"),
            (6, "taskRoles.worker.commands"),
        ]
    );
}

#[test]
fn display_names_file_line_column_field_and_fix() {
    let e = parse(&ok_role("    instance: 2\n")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "job.yaml:6:5: taskRoles.worker.instance: unknown field `instance`\n  fix: did you mean `instances`?"
    );
}

#[test]
fn load_reports_unreadable_file_at_line_zero() {
    let e = load_job_spec(Path::new("/nonexistent/job.yaml")).unwrap_err();
    assert_eq!((e.0[0].line, e.0[0].source.as_str()), (0, "/nonexistent/job.yaml"));
    assert!(e.0[0].message.contains("cannot read"), "{e}");
}

#[test]
fn load_reads_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("j.yaml");
    std::fs::write(&p, ok_role("")).unwrap();
    assert_eq!(load_job_spec(&p).unwrap().name, "job");
    std::fs::write(&p, [0xff, 0xfe]).unwrap();
    assert!(load_job_spec(&p).unwrap_err().0[0].message.contains("UTF-8"));
}

// ---- the example files ----

fn examples() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .map(|p| (p.display().to_string(), std::fs::read_to_string(&p).unwrap()))
        .collect();
    out.sort();
    out
}

#[test]
fn every_example_parses() {
    let ex = examples();
    assert!(ex.len() >= 4, "expected the example files");
    for (path, text) in &ex {
        assert!(
            text.starts_with('#'),
            "{path} starts with a comment saying what it shows"
        );
        if let Err(e) = parse_job_spec(text, path) {
            panic!("{e}");
        }
    }
}

#[test]
fn examples_say_what_they_promise() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let single = load_job_spec(&dir.join("single-gpu.yaml")).unwrap();
    assert_eq!((single.total_tasks(), single.task_roles[0].resources.gpus), (1, 1));

    let ddp = load_job_spec(&dir.join("ddp-4x2.yaml")).unwrap();
    let w = ddp.role("worker").unwrap();
    assert!(ddp.gang);
    assert_eq!(
        (w.instances, w.resources.gpus, w.resources.dynamic_port_count()),
        (4, 2, 2)
    );

    let ps = load_job_spec(&dir.join("ps-worker.yaml")).unwrap();
    let (p, w) = (ps.role("ps").unwrap(), ps.role("worker").unwrap());
    assert_eq!(p.resources.gpus, 0);
    assert_eq!(
        p.completion,
        Completion {
            min_failed_instances: Some(1),
            min_succeeded_instances: None
        }
    );
    assert_eq!(w.completion.min_succeeded_instances, Some(w.instances));
    assert!(w.resources.gpus > 0);

    let pai = load_job_spec(&dir.join("pai-v2.yaml")).unwrap();
    assert_eq!(pai.format, SpecFormat::PaiV2);
    assert!(
        pai.task_roles[0].commands[0].contains("resnet50 for 3 epochs"),
        "{:?}",
        pai.task_roles[0].commands
    );
}

// ---- never panics ----

mod no_panic {
    use super::*;
    use proptest::prelude::*;

    /// Parsing `text` ends in a spec or in errors that each have a position-bearing message,
    /// and never in the catch-all the YAML layer reports when its parser panicked (a
    /// panic would otherwise pass as an ordinary error).
    fn no_catch_all(text: &str) -> Result<(), TestCaseError> {
        if let Err(e) = parse(text) {
            for x in &e.0 {
                prop_assert!(!x.message.is_empty());
                prop_assert!(
                    !x.message.contains(crate::spec::yaml::PARSER_FAILED),
                    "the parser panicked on {:?}: {}",
                    text,
                    x
                );
            }
        }
        Ok(())
    }

    fn example_texts() -> Vec<String> {
        examples().into_iter().map(|(_, t)| t).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        #[test]
        fn random_text(text in "\\PC{0,300}") {
            no_catch_all(&text)?;
        }

        #[test]
        fn yaml_like_text(text in "[-a-zA-Z0-9:{}\\[\\],&*!|>'\"#%@` \n]{0,300}") {
            no_catch_all(&text)?;
        }

        #[test]
        fn text_with_control_characters(text in "[-a-z0-9:{}\\[\\] \n\"\\\\\u{0}\u{1b}\u{7f}\u{85}\t\r]{0,200}") {
            no_catch_all(&text)?;
        }

        #[test]
        fn mutated_examples(which in 0usize..16, ops in prop::collection::vec((0usize..4000, 0usize..8, "[-a-z0-9:{}\\[\\],&*'\" \n]{0,10}"), 1..5)) {
            let texts = example_texts();
            let mut text = texts[which % texts.len()].clone();
            for (at, cut, insert) in ops {
                let mut at = at.min(text.len());
                while !text.is_char_boundary(at) { at -= 1; }
                let mut end = (at + cut).min(text.len());
                while !text.is_char_boundary(end) { end -= 1; }
                text.replace_range(at..end, &insert);
            }
            no_catch_all(&text)?;
        }
    }

    /// The check above can fail: the catch-all is what a parser panic turns into.
    #[test]
    fn the_catch_all_is_what_a_panic_becomes() {
        let caught = std::panic::catch_unwind(|| panic!("a parser bug")).is_err();
        assert!(caught);
        assert!(crate::spec::yaml::PARSER_FAILED.contains("parser failed"));
    }
}

#[test]
fn crlf_line_endings_and_bom_are_accepted() {
    let text = format!("\u{feff}{}", ok_role("    instance: 2\n").replace('\n', "\r\n"));
    let e = errors(&text);
    assert_eq!(
        (e[0].field.as_str(), e[0].line, e[0].col),
        ("taskRoles.worker.instance", 6, 5)
    );
    assert!(parse(&format!("\u{feff}{}", ok_role("").replace('\n', "\r\n"))).is_ok());
}

#[test]
fn full_64_bit_mask() {
    let s = parse(&role(&format!(
        "    resourcePerInstance: {{cpu: 1, memoryMB: 1, gpu: 64, gpuMask: 0xffffffffffffffff}}\n{CMD}"
    )))
    .unwrap();
    assert_eq!(s.task_roles[0].resources.gpu_mask, Some(u64::MAX));
}

#[test]
fn tabs_in_indentation_are_a_syntax_error_with_position() {
    let e = errors("name: job\ntaskRoles:\n\tworker: {}\n");
    assert_eq!(e.len(), 1);
    assert!(e[0].message.contains("syntax") && e[0].line == 3, "{}", e[0]);
}

#[test]
fn error_count_is_capped() {
    let keys: String = (0..300).map(|i| format!("bad{i}: 1\n")).collect();
    let e = errors(&format!("{}{keys}", ok_role("")));
    assert_eq!(e.len(), yaml::MAX_ERRORS + 1);
    assert!(
        e.last().unwrap().message.contains("200 more errors"),
        "{}",
        e.last().unwrap()
    );
}

#[test]
fn huge_mappings_stay_fast() {
    let keys: String = (0..60_000).map(|i| format!("  k{i}: 1\n")).collect();
    let start = std::time::Instant::now();
    let e = errors(&v2(&format!("parameters:\n{keys}  k7: 2\n{V2_ROLE}")));
    // The duplicate, and (60,000 of them) more parameters than a spec may have.
    assert_eq!(e.len(), 2, "{}", SpecErrors(e.clone()));
    assert!(
        e.iter()
            .any(|e| e.message.contains("duplicate key `k7` (first given on line 12)")),
        "{}",
        SpecErrors(e.clone())
    );
    assert!(start.elapsed().as_secs() < 5, "took {:?}", start.elapsed());
}

// ---- OpenPAI v2: references, mapping, warnings ----

const PAI_FULL: &str = "protocolVersion: 2
name: full
type: job
prerequisites:
  - {name: img, type: dockerimage, uri: 'x/y:1'}
  - {name: d, type: data, uri: [a, b]}
taskRoles:
  w:
    instances: 2
    taskRetryCount: 4
    dockerImage: img
    data: d
    extraContainerOptions: {shmMB: 256, infiniband: true}
    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 1, ports: {ssh: 2, nccl: 1}}
    commands:
      - echo <% $data.uri[1] %> \\
      - continued
      - false
defaults: {virtualCluster: research}
extras:
  hivedScheduler:
    taskRoles:
      w: {skuType: V100, skuNum: 1}
  com.microsoft.pai.runtimeplugin:
    - plugin: ssh
    - plugin: tensorboard
";

#[test]
fn v2_maps_image_shm_gpu_type_queue_and_ports() {
    let s = parse(PAI_FULL).unwrap();
    let w = &s.task_roles[0];
    assert_eq!(w.image.as_deref(), Some("x/y:1"));
    assert_eq!(w.shm_mb, Some(256));
    assert_eq!(w.gpu_types, vec!["V100"]);
    assert_eq!(s.queue.as_deref(), Some("research"));
    let labels: Vec<(&str, u16)> = w.resources.ports.iter().map(|p| (p.label.as_str(), p.count)).collect();
    // `ssh` as written; `http` added, as OpenPAI adds both to every role.
    assert_eq!(labels, vec![("ssh", 2), ("nccl", 1), ("http", 1)]);
    // One script, the `\` continuation kept, the failing line kept.
    assert_eq!(w.commands, vec!["echo b \\\ncontinued\nfalse"]);
    // Under gang allocation taskRetryCount is ignored, as on OpenPAI.
    assert_eq!(w.task_retry_count, 0);
}

#[test]
fn v2_warns_about_what_it_does_not_honour_with_lines() {
    let s = parse(PAI_FULL).unwrap();
    let got: Vec<(usize, &str)> = s.warnings.iter().map(|w| (w.line, w.field.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (10, "taskRoles.w.taskRetryCount"),
            (13, "taskRoles.w.extraContainerOptions.infiniband"),
            (23, "extras.hivedScheduler.taskRoles.w.skuNum"),
            (25, "extras.com.microsoft.pai.runtimeplugin[0]"),
            (26, "extras.com.microsoft.pai.runtimeplugin[1]"),
        ],
        "{:#?}",
        s.warnings
    );
    assert!(s.warnings[3].message.contains("`ssh`"), "{}", s.warnings[3]);
}

#[test]
fn v2_task_retry_count_is_kept_without_gang() {
    let text = PAI_FULL.replace("extras:\n", "extras:\n  gangAllocation: false\n");
    let s = parse(&text).unwrap();
    assert_eq!(s.task_roles[0].task_retry_count, 4);
    assert!(!s.gang);
    assert!(s.warnings.iter().all(|w| w.field != "taskRoles.w.taskRetryCount"));
}

#[test]
fn v2_dangling_references_are_refused_at_their_line() {
    let text = PAI_FULL.replace("    data: d\n", "    data: nope\n    script: s\n");
    let e = errors(&text);
    let got: Vec<(usize, &str)> = e.iter().map(|e| (e.line, e.field.as_str())).collect();
    assert_eq!(got, vec![(12, "taskRoles.w.data"), (13, "taskRoles.w.script")]);
    assert!(
        e[0].message.contains("prerequisite \"nope\" does not exist"),
        "{}",
        e[0]
    );
}

#[test]
fn v2_job_retry_count_and_version_in_deployments() {
    let text = v2("jobRetryCount: 3\ndeployments:\n  - name: d\n    version: 2\n    taskRoles:\n      w: {preCommands: [pre]}\ndefaults: {deployment: d}\ntaskRoles:\n  w:\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [main]\n");
    let s = parse(&text).unwrap();
    assert_eq!(s.pai.as_ref().map(|p| p.job_retry_count), Some(3));
    assert_eq!(s.task_roles[0].commands, vec!["pre\nmain"]);
    assert_eq!(s.warnings.len(), 1);
    assert_eq!(
        (s.warnings[0].line, s.warnings[0].field.as_str()),
        (7, "deployments[0].version")
    );
}

// ---- control characters ----

#[test]
fn control_characters_are_refused_with_field_line_and_column() {
    // A NUL written as an escape in a double-quoted command (the "transient" loop).
    let e = one(
        &role(&format!("{RES}    commands: [\"echo \\0 hi\"]\n")),
        "taskRoles.worker.commands[0]",
        5,
        "control character U+0000",
    );
    assert!(e.fix.contains("printable"), "{e}");
    // Literal ESC and NUL: reported at the character itself.
    let text = role(&format!("{RES}    commands:\n      - \"echo \x1b[31mred\"\n"));
    let e = one(&text, "taskRoles.worker.commands[0]", 6, "U+001B");
    assert_eq!(e.col, 15, "{e}");
    let text = format!("name: jo\0b\ntaskRoles:\n  worker:\n{RES}{CMD}");
    let e = errors(&text);
    assert!(
        e.iter()
            .any(|x| x.field == "name" && x.line == 1 && x.col == 9 && x.message.contains("U+0000")),
        "{}",
        SpecErrors(e.clone())
    );
    // Tabs and newlines stay allowed.
    parse(&role(&format!(
        "{RES}    commands:\n      - |\n        echo\ta\n        echo b\n"
    )))
    .unwrap();
}

/// OpenPAI's current rest-server schema: script/data/output prerequisites need only `name`
/// and `type` (`plugin`, `require`, `callbacks`, plugin fields allowed, warned as not run);
/// a `dockerimage` still needs `uri` and takes no plugin field; a role's `prerequisites`
/// list must name existing ones.
#[test]
fn v2_prerequisites_follow_openpais_current_schema() {
    let prereqs = "prerequisites:\n  - {name: img, type: dockerimage, uri: busybox}\n  - name: setup\n    type: script\n    plugin: com.microsoft.pai.runtimeplugin.cmd\n    require: [data1]\n    callbacks: [{event: taskStarts, commands: [echo hi]}]\n    workdir: /tmp\n  - {name: data1, type: data}\n  - {name: out, type: output}\n";
    let role = "taskRoles:\n  worker:\n    dockerImage: img\n    script: setup\n    data: data1\n    output: out\n    prerequisites: [setup, data1]\n    resourcePerInstance: {cpu: 1, memoryMB: 1, gpu: 0}\n    commands: [\"echo <% $script.uri %>\"]\n";
    let s = parse(&v2(&format!("{prereqs}{role}"))).unwrap_or_else(|e| panic!("{e}"));
    let warned: Vec<&str> = s.warnings.iter().map(|w| w.field.as_str()).collect();
    for f in [
        "prerequisites[1].plugin",
        "prerequisites[1].require",
        "prerequisites[1].callbacks",
        "prerequisites[1].workdir",
    ] {
        assert!(warned.contains(&f), "{f} not warned: {warned:?}");
    }
    // A role's list names a prerequisite that does not exist: OpenPAI's reason, its line.
    let text = v2(&format!("{prereqs}{}", role.replace("[setup, data1]", "[setup, nope]")));
    let e = one(
        &text,
        "taskRoles.worker.prerequisites[1]",
        20,
        "prerequisite \"nope\" does not exist",
    );
    assert!(e.fix.contains("top-level `prerequisites`"), "{e}");
    // A dockerimage keeps OpenPAI's closed schema: `uri` required, no plugin fields.
    let text = v2(&format!(
        "prerequisites:\n  - {{name: img, type: dockerimage, plugin: cmd}}\n{V2_ROLE}    dockerImage: img\n"
    ));
    let e = errors(&text);
    let mut got: Vec<&str> = e.iter().map(|e| e.field.as_str()).collect();
    got.sort();
    assert_eq!(
        got,
        vec!["prerequisites[0].plugin", "prerequisites[0].uri"],
        "{}",
        SpecErrors(e.clone())
    );
    // Types still hold where a field is given.
    let text = v2(&format!("prerequisites:\n  - {{name: img, type: dockerimage, uri: b}}\n  - {{name: s, type: script, require: x, uri: [a]}}\n{V2_ROLE}    dockerImage: img\n"));
    let mut got: Vec<String> = errors(&text).iter().map(|e| e.field.clone()).collect();
    got.sort();
    assert_eq!(got, vec!["prerequisites[1].require", "prerequisites[1].uri"]);
}

/// `allowMixedGpuTypes` (issue 27): off by default, on the job or on a role, a bool; an
/// OpenPAI v2 role accepts it as gpuam's extension.
#[test]
fn allow_mixed_gpu_types_on_the_job_or_a_role() {
    let plain = parse(&ok_role("")).unwrap();
    assert!(!plain.allow_mixed_gpu_types && !plain.task_roles[0].allow_mixed_gpu_types);
    assert!(!plain.mixes_gpu_types(&plain.task_roles[0]));
    let on_role = parse(&ok_role("    allowMixedGpuTypes: true\n")).unwrap();
    assert!(on_role.task_roles[0].allow_mixed_gpu_types && on_role.mixes_gpu_types(&on_role.task_roles[0]));
    let on_job = parse(&format!("allowMixedGpuTypes: true\n{}", ok_role(""))).unwrap();
    assert!(on_job.allow_mixed_gpu_types && on_job.mixes_gpu_types(&on_job.task_roles[0]));
    one(
        &ok_role("    allowMixedGpuTypes: sometimes\n"),
        "taskRoles.worker.allowMixedGpuTypes",
        6,
        "true or false",
    );
    let pai = parse(&v2(V2_ROLE).replacen("    commands:", "    allowMixedGpuTypes: true\n    commands:", 1)).unwrap();
    assert!(pai.task_roles.iter().any(|r| r.allow_mixed_gpu_types));
    assert!(parse(&v2(V2_ROLE)).is_ok_and(|j| j.task_roles.iter().all(|r| !r.allow_mixed_gpu_types)));
}

/// `maxRunSec` (issue 27): on the job, on a role (the role's wins), whole seconds within
/// the limit; an OpenPAI v2 job writes the job's in `extras.maxRunSec`.
#[test]
fn max_run_sec_on_the_job_or_a_role_the_role_winning() {
    let plain = parse(&ok_role("")).unwrap();
    assert_eq!((plain.max_run_sec, plain.task_roles[0].max_run_sec), (None, None));
    let on_job = parse(&format!("maxRunSec: 3600\n{}", ok_role(""))).unwrap();
    assert_eq!(
        (on_job.max_run_sec, on_job.task_roles[0].max_run_sec),
        (Some(3600), Some(3600))
    );
    let both = parse(&format!("maxRunSec: 3600\n{}", ok_role("    maxRunSec: 60\n"))).unwrap();
    assert_eq!(both.task_roles[0].max_run_sec, Some(60));
    let e = one(&ok_role("    maxRunSec: 0\n"), "taskRoles.worker.maxRunSec", 6, "");
    assert!(e.fix.contains("1 to 31536000"), "{e}");
    one(
        &ok_role("    maxRunSec: an hour\n"),
        "taskRoles.worker.maxRunSec",
        6,
        "",
    );
    let e = one(&format!("maxRunSec: -5\n{}", ok_role("")), "maxRunSec", 1, "negative");
    assert!(!e.fix.is_empty());
    // A near miss is named.
    let e = one(&ok_role("    timeLimit: 60\n"), "taskRoles.worker.timeLimit", 6, "");
    assert!(e.to_string().contains("maxRunSec"), "{e}");
    // OpenPAI v2: the job's in extras, a role's as gpuam's extension.
    let pai = parse(&v2(&format!("extras: {{maxRunSec: 120}}\n{V2_ROLE}"))).unwrap();
    assert_eq!(pai.task_roles[0].max_run_sec, Some(120));
    assert!(
        pai.warnings.iter().all(|w| !w.field.contains("maxRunSec")),
        "{:?}",
        pai.warnings
    );
    let pai = parse(&v2(&V2_ROLE.replacen(
        "    commands:",
        "    maxRunSec: 30\n    commands:",
        1,
    )))
    .unwrap();
    assert_eq!(pai.task_roles[0].max_run_sec, Some(30));
}
