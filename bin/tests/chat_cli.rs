//! `cpl data render`: chat data rendered by a chat template, with its trained tokens.

mod common;

use common::{assert_clear_errors, cpl, fixtures, stderr, stdout, tmpdir};
use models::tokenizer::{SpecialTokens, Tokenizer};

fn path(rel: &str) -> String {
    fixtures(rel).display().to_string()
}

/// The JSON objects `cpl data render ... --json` prints, one per line.
fn render_json(extra: &[&str]) -> Vec<serde_json::Value> {
    let tok = path("chat/tokenizer");
    let data = path("chat/chat.jsonl");
    let tpl = path("chat/templates/llama3.jinja");
    let mut args = vec![
        "data",
        "render",
        "--model",
        &tok,
        "--data",
        &data,
        "--template",
        &tpl,
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = cpl(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn trained(v: &serde_json::Value) -> Vec<bool> {
    serde_json::from_value(v["trained"].clone()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v["ids"].clone()).unwrap()
}

/// The text of the trained tokens (which are contiguous runs at the end of each reply).
fn trained_text(tok: &Tokenizer, v: &serde_json::Value) -> String {
    let ids: Vec<u32> = ids(v)
        .into_iter()
        .zip(trained(v))
        .filter(|(_, t)| *t)
        .map(|(i, _)| i)
        .collect();
    tok.decode(&ids, SpecialTokens::Keep).unwrap()
}

#[test]
fn render_prints_text_ids_and_trained_tokens() {
    let tok = Tokenizer::from_files(
        &fixtures("chat/tokenizer/tokenizer.json"),
        Some(&fixtures("chat/tokenizer/tokenizer_config.json")),
    )
    .unwrap();
    let all = render_json(&[]);
    assert_eq!(all.len(), 3);
    let second = &all[1];
    assert!(second["source"]
        .as_str()
        .unwrap()
        .ends_with("chat/chat.jsonl line 2"));
    assert_eq!(
        second["text"],
        "<s><|start_header_id|>user<|end_header_id|>\n\nTwo and two?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nfour<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nAnd three and three?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nsix<|eot_id|>"
    );
    // The rendered text tokenized without added special tokens (the template wrote <s>).
    let (want_ids, _) = tok
        .encode_with_offsets(second["text"].as_str().unwrap())
        .unwrap();
    assert_eq!(ids(second), want_ids);
    assert_eq!(ids(second)[0], 1);
    let t = trained(second);
    assert_eq!(t.len(), want_ids.len());
    assert_eq!(trained_text(&tok, second), "four<|eot_id|>six<|eot_id|>");
    assert!(!t[0] && t[t.len() - 1]);

    // --mask-history: only the last reply; --limit.
    let last = render_json(&["--mask-history", "--limit", "2"]);
    assert_eq!(last.len(), 2);
    assert_eq!(trained_text(&tok, &last[1]), "six<|eot_id|>");
    assert_eq!(ids(&last[1]), ids(second));
    // --train-on-prompt: everything.
    let all_on = render_json(&["--train-on-prompt", "--limit", "1"]);
    assert!(trained(&all_on[0]).iter().all(|&t| t));

    // The human form marks the trained spans.
    let o = cpl(&[
        "data",
        "render",
        "--model",
        &path("chat/tokenizer"),
        "--data",
        &path("chat/chat.jsonl"),
        "--template",
        "chatml",
        "--limit",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("<|im_start|>assistant\n⟦four<|im_end|>\n⟧<|im_start|>user"),
        "{out}"
    );
    assert!(out.contains("chat.jsonl line 2"), "{out}");
    assert_eq!(out.matches("trained: ").count(), 2, "{out}");
}

#[test]
fn render_errors_are_clear() {
    let dir = tmpdir("chat-render");
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"content\": \"A\"}]}\n\
         {\"messages\": [{\"role\": \"assistant\", \"content\": \"A\"}]}\n",
    )
    .unwrap();
    let tok = path("chat/tokenizer");
    let data = path("chat/chat.jsonl");
    let bad = bad.display().to_string();
    let tool = dir.join("tool.jsonl");
    std::fs::write(
        &tool,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"content\": \"A\"}, {\"role\": \"tool\", \"content\": \"T\"}, {\"role\": \"assistant\", \"content\": \"B\"}]}\n",
    )
    .unwrap();
    let tool = tool.display().to_string();
    let llama3 = path("chat/templates/llama3.jinja");
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_clear_errors(&[
        (
            args(&["data", "render", "--model", &tok, "--data", &data]),
            "pass --template chatml",
        ),
        (
            args(&[
                "data",
                "render",
                "--model",
                &tok,
                "--data",
                &data,
                "--template",
                "vicuna",
            ]),
            "neither a built-in template (chatml, plain) nor a file",
        ),
        (
            args(&[
                "data",
                "render",
                "--model",
                &tok,
                "--data",
                &bad,
                "--template",
                "chatml",
            ]),
            "bad.jsonl: line 2: message 0 (assistant): roles out of order",
        ),
        (
            args(&[
                "data",
                "render",
                "--model",
                &tok,
                "--data",
                &tool,
                "--template",
                &llama3,
            ]),
            "tool.jsonl line 1: Only user and assistant roles are supported",
        ),
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
}
