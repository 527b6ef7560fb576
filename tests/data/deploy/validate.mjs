// Validates Prometheus operator objects (JSON, one per argument file) with the operator's own
// models (npm @kubernetes-models/prometheus-operator, its JSON schemas through ajv).
// Usage: node validate.mjs MODELS_DIR FILE.json...   Exit 1 with the errors when one is invalid.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [models, ...files] = process.argv.slice(2);
const v1 = await import(pathToFileURL(`${models}/node_modules/@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/index.js`).href);
let bad = 0;
for (const f of files) {
  const obj = JSON.parse(readFileSync(f, "utf8"));
  const Kind = v1[obj.kind];
  if (obj.apiVersion !== "monitoring.coreos.com/v1" || !Kind) {
    console.log(`${f}: not a monitoring.coreos.com/v1 kind the models know: ${obj.apiVersion} ${obj.kind}`);
    bad++;
    continue;
  }
  try {
    new Kind(obj).validate();
    console.log(`${f}: ${obj.kind} ${obj.metadata?.name} valid`);
  } catch (e) {
    console.log(`${f}: ${obj.kind} invalid: ${e.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
