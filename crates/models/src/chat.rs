//! Chat templates rendered by a Jinja engine: `minijinja` (the engine candle's own examples
//! use), set up as Hugging Face's `apply_chat_template` sets up Jinja2: `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (`.strip()`, `.startswith()`, … through
//! `minijinja-contrib`'s pycompat), and `raise_exception(msg)`. A template comes from a GGUF
//! file's `tokenizer.chat_template` or a folder's tokenizer_config.json `chat_template`.

use minijinja::{context, Environment, Error, ErrorKind};

/// Renders `template` for one user turn and the assistant's prompt:
/// `messages = [{role: "user", content: user_prompt}]`, `add_generation_prompt = true`, and
/// `bos_token` / `eos_token` as the tokenizer's texts for them (empty when it has none).
///
/// # Errors
/// A one-line message when the template does not parse, fails to render (an undefined call, a
/// `raise_exception`), or renders nothing.
pub fn render(template: &str, user_prompt: &str, bos_token: &str, eos_token: &str) -> Result<String, String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    let one_line = |e: Error| {
        let mut msg = e.to_string();
        if let Some(detail) = e.detail() {
            if !msg.contains(detail) {
                msg = format!("{msg}: {detail}");
            }
        }
        format!("chat template: {}", msg.lines().next().unwrap_or_default())
    };
    env.add_template("chat", template).map_err(one_line)?;
    let messages = vec![context! { role => "user", content => user_prompt }];
    let out = env.get_template("chat").map_err(one_line)?.render(context! { messages => messages, add_generation_prompt => true, bos_token => bos_token, eos_token => eos_token }).map_err(one_line)?;
    if out.trim().is_empty() {
        return Err("chat template: renders nothing for a user turn".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::render;

    /// SmolLM2-Instruct's template (from its GGUF file and tokenizer_config.json).
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Qwen2-Instruct's template.
    const QWEN2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Gemma 3's template (tokenizer_config.json of the instruction-tuned models): `bos_token`,
    /// role alternation checked with `raise_exception`, `model` for the assistant, `| trim`.
    const GEMMA3: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

    #[test]
    fn smollm2_qwen2_and_gemma3_templates_render() {
        assert_eq!(
            render(SMOLLM2, "Tell me about Richard Feynman.", "", "<|im_end|>").unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nTell me about Richard Feynman.<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(render(QWEN2, "hi", "", "<|endoftext|>").unwrap(), "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(render(GEMMA3, "  The capital of France is \n", "<bos>", "<eos>").unwrap(), "<bos><start_of_turn>user\nThe capital of France is<end_of_turn>\n<start_of_turn>model\n");
    }

    /// The constructs Qwen 3's template uses: a namespace set in a reversed loop, `is string` /
    /// `is defined` tests, `startswith`/`endswith`/`split`/`rstrip`/`lstrip`, a `tojson` branch not
    /// taken (no tools), and the thinking switch after the generation prompt.
    const QWEN3_STYLE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + content.rstrip('\n') + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

    #[test]
    fn qwen3_style_template_renders() {
        assert_eq!(render(QWEN3_STYLE, "hi", "", "<|im_end|>").unwrap(), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(render(QWEN3_STYLE, "<think>x</think>\nhi\n", "", "").unwrap(), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_and_errors() {
        let t = "{{ messages[0]['content'].strip().upper() }}{% if messages[0]['content'].startswith(' x') %}!{% endif %}";
        assert_eq!(render(t, " xy ", "", "").unwrap(), "XY!");
        let e = render("{{ raise_exception('no system role here') }}", "hi", "", "").unwrap_err();
        assert!(e.starts_with("chat template:") && e.contains("no system role here") && !e.contains('\n'), "{e}");
        let e = render("{% for %}", "hi", "", "").unwrap_err();
        assert!(e.starts_with("chat template:") && !e.contains('\n'), "{e}");
        assert!(render("{% if false %}x{% endif %}", "hi", "", "").is_err());
    }
}
