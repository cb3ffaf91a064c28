// A completion's tokens as coloured spans, built from plain data: the Token inspector's component
// (token_view.js) and the report's token section (dashboard/report.py) both draw with these two functions.
// data: dashboard.tokens.token_spans's lists (position, text, colour, clip, rejected, heading by token; the hover
//       values by column; palette, styles, the clip and rejection names) and the CSS of the block and of every
//       token (block_style, token_style).
// Logged text only ever becomes text nodes and attribute values: nothing from a run is parsed as markup.

function hoverText(data, i) {
  // The token's position and text, a line per column ("advantage: 0.1234"), its clip, its rejection if any.
  const lines = [data.heading[i]];
  data.hover.names.forEach((name, column) => lines.push(`${name}: ${data.hover.values[column][i]}`));
  if (Object.keys(data.clip_names).length) lines.push(`clip: ${data.clip_names[data.clip[i]] ?? data.clip[i]}`);
  if (data.rejected[i]) lines.push(`rejected: ${data.reject_names[data.rejected[i]] ?? data.rejected[i]}`);
  return lines.join("\n");
}

function tokenSpan(data, i) {
  const span = document.createElement("span");
  span.className = "pl-token";
  span.dataset.position = data.position[i] ?? "";
  span.dataset.clip = data.clip[i];
  span.dataset.rejected = data.rejected[i];
  span.title = hoverText(data, i);
  const [background, colour] = data.colour[i] >= 0 ? data.palette[data.colour[i]] : ["transparent", "inherit"];
  span.style.cssText = `background:${background};color:${colour};${data.token_style}`
    + (data.styles[data.clip[i]] ?? "") + (data.rejected[i] ? data.styles.rejected : "");
  // A newline keeps its line break: the text after it goes on the next line.
  data.text[i].split("\n").forEach((line, j) => {
    if (j) span.appendChild(document.createElement("br"));
    span.appendChild(document.createTextNode(line));
  });
  return span;
}

function drawTokens(block, data) {
  block.style.cssText = data.block_style;
  const spans = document.createDocumentFragment();
  for (let i = 0; i < data.text.length; i++) spans.appendChild(tokenSpan(data, i));
  block.replaceChildren(spans);
}
